"""Linear layers of one model instance in its weight format: dense (the model dtype) or weight-only int8.

``WEIGHT_QUANTS`` names the formats a config may ask for (``EngineConfig.weight_quant``):

- ``"none"``: weights in the model dtype (float32 or bfloat16).
- ``"int8"``: each output row ``n`` of a weight ``[N, K]`` stored as ``round(W[n] / s[n])`` in int8 with
  ``s[n] = max|W[n]| / 127`` (symmetric, per output channel), quantized once at load. Activations, norms and
  the KV cache stay in the model dtype. A tied embedding shares the int8 rows of the LM head (a lookup
  dequantizes the looked-up rows only).

Small batches (at most ``SMALL_BATCH_ROWS`` rows, i.e. decode) run on the kernels of ``kernels/``, which read
each weight byte once per step (AVX2 + FMA; bf16 against bf16 on AVX512_BF16's dot products where the CPU has
them, which at 16 rows take half the AVX2 loop's time); larger ones (prefill chunks) on torch's BLAS after
widening one weight at a time to float32 (int8 always; bf16 where the CPU has no native bf16 GEMM, i.e. below
AVX-512). Without the kernels (another CPU, a GPU, no compiler) every product goes through torch. On the
kernels a row's result does not depend on the other rows of its batch (they sum every row in the same order),
so a decode step gives the same numbers alone or batched with up to ``SMALL_BATCH_ROWS`` rows. Torch's BLAS
gives no such promise: its blocking varies with the row count, so a prompt's numbers depend on the other
prompts of its step (seen in bf16: in 3 of 21 rounds of six concurrent PD requests one greedy text took
another word at a near tie).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.kernels import gemv_kernels

WEIGHT_QUANTS: tuple[str, ...] = ("none", "int8")
SMALL_BATCH_ROWS = 16  # the kernels beat torch's products up to here (docs/benchmarks.md, "Weight dtypes")


class Int8Weight(nn.Module):
    """A weight ``[N, K]`` as int8 rows and one float32 scale per row (``W ≈ qweight * scale[:, None]``).

    Attributes:
        qweight: ``[N, K]`` int8, contiguous.
        scale: ``[N]`` float32.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Quantize a float weight ``[N, K]`` (any float dtype) row by row; an all-zero row gets scale 1."""
        w = weight.to(torch.float32)
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight (or only its ``rows``, an index tensor) in ``dtype``."""
        q, s = (self.qweight, self.scale) if rows is None else (self.qweight[rows], self.scale[rows])
        return (q.to(torch.float32) * s[..., None]).to(dtype)


Weight = torch.Tensor | Int8Weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` in the model dtype; returns ``[M, N]`` in ``x.dtype``."""
    kernels = gemv_kernels() if x.device.type == "cpu" and x.shape[0] <= SMALL_BATCH_ROWS else None
    if kernels is not None and isinstance(weight, Int8Weight):
        y = kernels.int8(x.to(torch.float32).contiguous(), weight.qweight, weight.scale)
    elif kernels is not None and weight.dtype == torch.bfloat16 and weight.is_contiguous():
        if kernels.native_bf16 and x.dtype == torch.bfloat16:
            y = kernels.bf16_native(x.contiguous(), weight)
        else:
            y = kernels.bf16(x.to(torch.float32).contiguous(), weight)
    elif isinstance(weight, Int8Weight) or weight.dtype != x.dtype or _widen_bf16(x):
        wide = torch.float32 if _widen_bf16(x) else x.dtype
        dense = weight.dequantize(wide) if isinstance(weight, Int8Weight) else weight.to(wide)
        y = F.linear(x.to(wide), dense)
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        y += bias
    return y.to(x.dtype)


def _widen_bf16(x: torch.Tensor) -> bool:
    # without AVX-512 (no native bf16 in oneDNN), torch's bf16 GEMM is slower than fp32's: widen instead
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _cpu_lacks_bf16_gemm()


@functools.cache
def _cpu_lacks_bf16_gemm() -> bool:
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def embedding(token_ids: torch.Tensor, weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``token_ids`` (``[T]`` int64) of an embedding ``[V, H]``, as ``[T, H]`` in ``dtype``."""
    if isinstance(weight, Int8Weight):
        return weight.dequantize(dtype, token_ids)
    return F.embedding(token_ids, weight)


def weight_bytes(weight: Weight) -> int:
    """Bytes a full product with ``weight`` reads (int8 rows plus their scales)."""
    if isinstance(weight, Int8Weight):
        return weight.qweight.numel() + weight.scale.numel() * weight.scale.element_size()
    return weight.numel() * weight.element_size()
