"""Rotary position embeddings (RoPE: Su et al. 2021, arXiv:2104.09864), HF Llama "rotate_half" convention.

Dimension pair ``(i, i + head_dim/2)`` rotates by angle ``pos * theta ** (-2i / head_dim)``. The frequencies
are computed in fp32 exactly as transformers' default RoPE does, so logits match the reference closely.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, applied by absolute position.

    Buffers:
        cos_sin: ``[max_positions, head_dim]`` fp32; first half cos, second half sin of the ``head_dim/2``
            angles.
    """

    cos_sin: torch.Tensor  # [max_positions, head_dim] float32: cos then sin of each angle (a buffer)

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim/2]
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)
        self.head_dim = head_dim

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``[num_tokens, 1, head_dim]`` (halves duplicated) for ``positions``.

        Computed once per step and reused by every layer.
        """
        cs = self.cos_sin[positions].to(dtype)
        cos, sin = cs.chunk(2, dim=-1)
        return torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by ``cos``/``sin`` ``[num_tokens, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
