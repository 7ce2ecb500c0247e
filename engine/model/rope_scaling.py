"""RoPE scaling: how a model stretches its rotary positions past the context it was pre-trained on.

The kinds served, with transformers' ``modeling_rope_utils`` as the reference (``engine.model.rope`` turns
them into the inverse frequencies and cos/sin tables, once per model):

- ``linear`` (position interpolation, Chen et al. 2023, arXiv:2306.15595): every frequency divided by
  ``factor``.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3): wavelengths longer than ``original_max_position_embeddings /
  low_freq_factor`` divided by ``factor``, those shorter than ``original_max_position_embeddings /
  high_freq_factor`` kept, a linear blend between.
- ``yarn`` (Peng et al. 2023, arXiv:2309.00071; Qwen2.5's long context, DeepSeek-V3): each frequency a
  blend of the interpolated (divided by ``factor``) and the kept one, by a ramp over the dimensions that turn
  between ``beta_fast`` and ``beta_slow`` times within ``original_max_position_embeddings``; cos and sin
  multiplied by an attention factor; DeepSeek-V3's MLA also multiplies its softmax scale by ``mscale(factor,
  mscale_all_dim) ** 2`` (``mla_softmax_scale_factor``).

Refused by name: ``dynamic`` (NTK-aware scaling whose frequencies follow the running sequence's length) and
``longrope`` (factors that switch at a length): both change with the sequence, which one precomputed table,
and keys cached with the RoPE of the step that wrote them, cannot follow. So is any other ``rope_type``.

This module is torch-free: the config side (dataclasses, reading and writing ``config.json`` fields).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SERVED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
_SEQUENCE_DEPENDENT = {"dynamic": "NTK-aware scaling that changes with the sequence length",
                       "longrope": "factors that switch with the sequence length"}


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: positions (equivalently every frequency) divided by ``factor``."""

    factor: float
    rope_type: str = field(default="linear", init=False)

    def __post_init__(self) -> None:
        _check_positive(self, "factor")


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency-dependent scaling (transformers' ``_compute_llama3_parameters``).

    Attributes:
        factor: divisor of the low frequencies (Llama 3.1: 8).
        low_freq_factor, high_freq_factor: wavelengths above ``original_max_position_embeddings /
            low_freq_factor`` are divided by ``factor``, below ``.. / high_freq_factor`` kept (1 and 4).
        original_max_position_embeddings: the pre-training context, in tokens (8192).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = field(default="llama3", init=False)

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            _check_positive(self, name)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (transformers' ``_compute_yarn_parameters``; DeepSeek-V3's ``rope_scaling``).

    Attributes:
        factor: context extension ratio; the interpolated frequencies are divided by it (DeepSeek-V3: 40).
        original_max_position_embeddings: the pre-training context, in tokens (DeepSeek-V3: 4096).
        beta_fast, beta_slow: rotations within that context bounding the ramp: dimensions turning more than
            ``beta_fast`` times are kept, fewer than ``beta_slow`` times interpolated (32 and 1).
        mscale, mscale_all_dim: YaRN's temperature terms; with both set, the cos/sin factor is
            ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and DeepSeek-V3's softmax scale is
            multiplied by ``mscale(factor, mscale_all_dim) ** 2``.
        attention_factor: the cos/sin factor as given; None: derived (``cos_sin_factor``).
        truncate: the ramp's bounds rounded outwards to whole dimensions (transformers' default).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    rope_type: str = field(default="yarn", init=False)

    def __post_init__(self) -> None:
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            _check_positive(self, name)
        if self.attention_factor is not None:
            _check_positive(self, "attention_factor")


RopeScaling = LinearScaling | Llama3Scaling | YarnScaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin_factor(scaling: RopeScaling | None) -> float:
    """What every cos and sin is multiplied by: YaRN's attention factor, else 1."""
    if not isinstance(scaling, YarnScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
    return yarn_mscale(factor)


def mla_softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """What DeepSeek-V3's MLA multiplies its softmax scale by: ``mscale(factor, mscale_all_dim) ** 2`` for
    YaRN with a non-zero ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``), else 1."""
    if not isinstance(scaling, YarnScaling) or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def hf_rope_parameters(rope_theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """The ``rope_parameters`` dict transformers writes into ``config.json`` for this RoPE."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": rope_theta}
    fields = {k: v for k, v in asdict(scaling).items() if v is not None}
    return {"rope_type": fields.pop("rope_type"), **fields, "rope_theta": rope_theta}


def rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` (the ``ModelConfig`` keyword arguments) of a ``config.json``.

    Reads the older ``rope_scaling`` dict (``"type"`` or ``"rope_type"``, ``rope_theta`` beside it) or, when
    that is absent, the newer ``rope_parameters`` (``rope_theta`` inside), as transformers does; a top-level
    ``original_max_position_embeddings`` wins over the dict's, and without either it is
    ``max_position_embeddings``.

    Raises:
        KeyError: a field the RoPE type needs is absent (``"rope_scaling.factor"``).
        ValueError: an unserved RoPE type (named) or a value out of range (the field named).
    """
    name, params = ("rope_scaling", raw["rope_scaling"]) if raw.get("rope_scaling") else \
        ("rope_parameters", raw.get("rope_parameters") or {})
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{name} {params!r}: per-layer or malformed RoPE parameters are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type in _SEQUENCE_DEPENDENT:
        raise ValueError(f"{name} rope_type {rope_type!r} ({_SEQUENCE_DEPENDENT[rope_type]}) is not "
                         f"supported (served: {', '.join(SERVED_ROPE_TYPES)})")
    if rope_type not in SERVED_ROPE_TYPES:
        raise ValueError(f"{name} rope_type {rope_type!r} is not supported (served: "
                         f"{', '.join(SERVED_ROPE_TYPES)})")
    return {"rope_theta": theta, "rope_scaling": _scaling(rope_type, name, params, raw)}


def _scaling(rope_type: str, name: str, params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling | None:
    def optional(key: str) -> float | None:
        value = params.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}.{key} must be a number, got {value!r}")
        return float(value)

    def required(key: str) -> float:
        value = optional(key)
        if value is None:
            raise KeyError(f"{name}.{key}")
        return value

    if rope_type == "default":
        return None
    factor = required("factor")
    if rope_type == "linear":
        return LinearScaling(factor)
    # transformers: a top-level value wins (Phi-3's configs), then the dict's, then max_position_embeddings
    original = raw.get("original_max_position_embeddings") or optional("original_max_position_embeddings") \
        or raw.get("max_position_embeddings")
    if original is None:
        raise KeyError(f"{name}.original_max_position_embeddings")
    if rope_type == "llama3":
        return Llama3Scaling(factor, required("low_freq_factor"), required("high_freq_factor"), int(original))
    # transformers reads a missing or zero beta as its default
    return YarnScaling(factor, int(original), beta_fast=optional("beta_fast") or 32.0,
                       beta_slow=optional("beta_slow") or 1.0, mscale=optional("mscale"),
                       mscale_all_dim=optional("mscale_all_dim"),
                       attention_factor=optional("attention_factor"),
                       truncate=bool(params.get("truncate", True)))


def _check_positive(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not value > 0:
        raise ValueError(f"rope scaling {name} must be > 0, got {value!r}")
