"""Paged attention backends: a CPU torch implementation and flashinfer on CUDA."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def select_backend(device: str | torch.device) -> AttentionBackend:
    """flashinfer on a CUDA device when the package imports, the torch backend otherwise."""
    if torch.device(device).type == "cuda":
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend, flashinfer_available

        if flashinfer_available():
            return FlashInferAttentionBackend(torch.device(device))
    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "TorchAttentionBackend", "select_backend"]
