"""Paged attention backends: a CPU torch implementation and flashinfer on CUDA."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def select_backend(device: str | torch.device, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """flashinfer on a CUDA device for fp16/bf16 when the package imports; the torch backend otherwise.

    A flashinfer backend still needs ``bind(num_heads, num_kv_heads, head_dim, dtype)``; ``LlamaForCausalLM``
    does it when it adopts the backend.
    """
    from engine.attention.flashinfer_backend import (
        SUPPORTED_DTYPES,
        FlashInferAttentionBackend,
        flashinfer_available,
    )

    if torch.device(device).type == "cuda" and dtype in SUPPORTED_DTYPES and flashinfer_available():
        return FlashInferAttentionBackend(torch.device(device), dtype=dtype)
    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "TorchAttentionBackend", "select_backend"]
