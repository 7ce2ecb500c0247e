"""Rotary position embeddings (RoPE: Su et al. 2021, arXiv:2104.09864), HF Llama "rotate_half" convention.

Dimension pair ``(i, i + head_dim/2)`` rotates by angle ``pos * inv_freq[i]``, ``inv_freq[i] = theta **
(-2i / head_dim)`` rescaled by the model's RoPE scaling (``engine.model.rope_scaling``: linear, llama3, YaRN).
The frequencies are computed in fp32 in the order transformers' ``modeling_rope_utils`` computes them, so
logits match the reference closely.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.rope_scaling import LinearScaling, Llama3Scaling, RopeScaling, YarnScaling, cos_sin_factor


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """``[dim/2]`` fp32 angular frequencies (radians per position) of a rotated width ``dim``."""
    if isinstance(scaling, YarnScaling):
        return _yarn(dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, Llama3Scaling):
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    wavelen = 2 * math.pi / inv_freq
    context = s.original_max_position_embeddings
    long_wavelen, short_wavelen = context / s.low_freq_factor, context / s.high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, inv_freq / s.factor, inv_freq)
    # between the two wavelengths: 0 at long_wavelen (all scaled) .. 1 at short_wavelen (all kept)
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(between, blended, scaled)


def _yarn_dimension(rotations: float, dim: int, theta: float, context: int) -> float:
    """The (fractional) frequency index whose wavelength fits ``rotations`` times in ``context`` positions."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    low = _yarn_dimension(s.beta_fast, dim, theta, s.original_max_position_embeddings)
    high = _yarn_dimension(s.beta_slow, dim, theta, s.original_max_position_embeddings)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp   # [dim/2]: 1 below ``low`` (extrapolate: unchanged), 0 above ``high`` (interpolate)
    base = theta ** (torch.arange(0, dim, 2).float() / dim)
    return 1.0 / (s.factor * base) * (1 - keep) + 1.0 / base * keep


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, applied by absolute position.

    Args:
        head_dim: the rotated width.
        max_positions: rows of the table (the model's ``max_position_embeddings``).
        theta: the base frequency (``rope_theta``).
        scaling: the model's RoPE scaling; None: plain RoPE.

    Buffers:
        cos_sin: ``[max_positions, head_dim]`` fp32; first half cos, second half sin of the ``head_dim/2``
            angles, both multiplied by the scaling's cos/sin factor (YaRN's attention factor; else 1).
    """

    cos_sin: torch.Tensor  # [max_positions, head_dim] float32: cos then sin of each angle (a buffer)

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [max_positions, head_dim/2]
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1) * cos_sin_factor(scaling)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
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
