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

Dense bf16 weights on a CPU with AVX512_BF16 and no AMX (Zen 4, Cooper Lake) are instead held prepacked in
oneDNN's blocked layout (``PackedBF16Weight``), and every product of them, decode and prefill, runs on oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the prepacked path torch's own CPU inference uses): measured on such
a host, a SmolLM2 decode step's products at 16 rows in 0.6x the kernel's time, at 1 row in 0.9x; their rows
are checked at packing to be batch-invariant too. On AMX CPUs the weights stay plain: the kernel below
``AMX_ONEDNN_ROWS`` rows, oneDNN's AMX matmul from there, so there a row alone (the kernel) and the same row
in a batch of 8 or more (oneDNN) differ in rounding.
The kernels are single-threaded: with more than one torch thread on an AVX-512 CPU, a bf16 model's small
batches go to torch's multi-threaded products instead (``_threads_beat_kernels``), and the batch invariance
above holds at one thread (the engine's default) only.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.kernels import gemv_kernels

logger = logging.getLogger(__name__)

WEIGHT_QUANTS: tuple[str, ...] = ("none", "int8")
SMALL_BATCH_ROWS = 16  # the kernels beat torch's one-thread products up to here (measured at 1, 4, 16 rows)
#: on AMX CPUs, bf16 products of this many rows or more go to oneDNN's AMX matmul instead of the kernel:
#: measured there (1 thread, a SmolLM2 decode step's products) the kernel wins at 1, 2 and 4 rows and oneDNN
#: at 16 (0.5-0.6x the kernel's time); the engine's decode step at 8 rows ran the same on both
AMX_ONEDNN_ROWS = 8


class Int8Weight(nn.Module):
    """A weight ``[N, K]`` as int8 rows and one float32 scale per row (``W ≈ qweight * scale[:, None]``).

    Attributes:
        qweight: ``[N, K]`` int8, contiguous.
        scale: ``[N]`` float32.
    """

    qweight: torch.Tensor  # buffers: see Attributes
    scale: torch.Tensor

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

    def int8pack_mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` bfloat16 -> ``x @ (qweight * scale).T`` ``[M, N]`` bfloat16 through torch's
        multi-threaded weight-only int8 CPU product (``aten._weight_int8pack_mm``; the scales converted to
        bfloat16 once and kept)."""
        scale = getattr(self, "_scale_bf16", None)
        if scale is None:
            scale = self._scale_bf16 = self.scale.to(torch.bfloat16)
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, scale)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight (or only its ``rows``, an index tensor) in ``dtype``."""
        q, s = (self.qweight, self.scale) if rows is None else (self.qweight[rows], self.scale[rows])
        return (q.to(torch.float32) * s[..., None]).to(dtype)


class PackedBF16Weight(nn.Module):
    """A bfloat16 weight ``[N, K]`` prepacked for oneDNN's matmul
    (``torch.ops.mkldnn._reorder_linear_weight``, an opaque ``mkldnn`` tensor: no indexing, no views),
    multiplied by ``torch.ops.mkldnn._linear_pointwise``.

    Built by ``pack`` only where the rows of its products are batch-invariant at the current torch thread
    count: every row of an ``M``-row product (``M`` up to ``SMALL_BATCH_ROWS``) equals, bit for bit, that row
    multiplied alone. oneDNN gives no such promise, so ``pack`` checks it once per shape and thread count on
    seeded random rows: sub-batches of 2..15 rows against a 16-row product, and single rows, which oneDNN may
    route to another kernel (seen here: SmolLM2's ``576 x 1536`` at 1 and 2 threads, ``4096 x 4096`` at 2;
    and a row not 64-byte aligned, so ``matmul`` copies such a row first); where a single row differs, it is
    padded to two rows (the batches' kernel; the ``576 x 1536`` products of a SmolLM2 decode step then cost
    ~1 ms more). Checked at one thread from 2 to 128 rows, a row's product does not depend on its batch (a
    prefill chunk's rows too). CPU only; calls are synchronous and release the GIL inside oneDNN.

    Attributes:
        packed: the oneDNN tensor (a plain attribute: module machinery such as ``state_dict`` or ``to`` cannot
            handle ``mkldnn`` tensors).
        pad_single_row: the check found a single row's kernel to differ from a batch's.
    """

    #: rows the pack-time check multiplies (the decode batch bound of the kernels)
    CHECK_ROWS = SMALL_BATCH_ROWS
    #: the batch oneDNN lays the weight out for (``_reorder_linear_weight``'s ``batch_size``)
    PACK_ROWS = SMALL_BATCH_ROWS

    def __init__(self, packed: torch.Tensor, shape: torch.Size, pad_single_row: bool = False) -> None:
        super().__init__()
        self.packed = packed
        self.pad_single_row = pad_single_row
        self._shape = shape

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedBF16Weight | None:
        """The packed weight of a bfloat16 CPU ``weight`` ``[N, K]``, or None where oneDNN has no native bf16
        matmul here or its rows are not batch-invariant even padded (logged once per shape); the caller then
        keeps the plain weight on the kernels."""
        if not _pack_bf16_here() or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return None
        packed = cls(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), cls.PACK_ROWS),
                     weight.shape)
        key = (weight.shape[0], weight.shape[1], torch.get_num_threads())
        if key not in _SINGLE_ROW_MODE:  # a race only repeats the check
            _SINGLE_ROW_MODE[key] = _single_row_mode(packed)
        if _SINGLE_ROW_MODE[key] is None:
            return None
        packed.pad_single_row = _SINGLE_ROW_MODE[key] == "pad"
        return packed

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` bfloat16 -> ``x @ W.T`` ``[M, N]`` bfloat16."""
        x = x.to(torch.bfloat16).contiguous()
        if x.shape[0] == 1 and self.pad_single_row:
            x = torch.cat([x, torch.zeros_like(x)])
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")[:1]
        if x.shape[0] == 1 and x.data_ptr() % 64:
            x = x.clone()  # the allocator's 64-byte alignment, as in the pack-time check
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@functools.cache
def _pack_bf16_here() -> bool:
    """True where bf16 product weights are packed: oneDNN multiplies bf16 natively (AVX512_BF16) and the CPU
    has no AMX. On AMX (measured on a Xeon with 300 MB of L3, 1 thread) a weight packed for 16 rows decodes
    one row in 1.2-1.8x the AVX512_BF16 kernel's time inside the engine, so AMX CPUs keep plain weights: the
    kernel for fewer than ``AMX_ONEDNN_ROWS`` rows, oneDNN's unpacked bf16 matmul (AMX tiles) from there."""
    return (torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported()
            and not _cpu_has_amx())


@functools.cache
def _cpu_has_amx() -> bool:
    return torch.cpu._is_amx_tile_supported()


#: batches of ``PackedBF16Weight.CHECK_ROWS`` rows the pack-time check multiplies per weight shape
CHECK_BATCHES = 8
#: (N, K, torch threads) -> the pack-time check's verdict ("exact", "pad" or None); the first weight of a
#: shape stands for the others (oneDNN picks its kernels by shape, ISA and threads, not by values)
_SINGLE_ROW_MODE: dict[tuple[int, int, int], str | None] = {}


def _single_row_mode(weight: PackedBF16Weight) -> str | None:
    """``PackedBF16Weight``'s pack-time check: "exact" when every sub-batch and every single row equals its
    rows of a 16-row product, "pad" when single rows do only padded to two, None otherwise (logged).

    The inputs are what a decode step feeds the products, not plain Gaussian rows: ``silu(a) * b`` of seeded
    Gaussians (the MLP's down product sees exactly that), heavy-tailed, over ``CHECK_BATCHES`` batches of
    ``CHECK_ROWS``. A kernel that sums in another order differs from the batch's only where the bf16 result
    rounds differently: on SmolLM2's ``576 x 1536`` one-row kernel, in 31 of 320 such rows and in none of 16
    Gaussian rows (an operator's trial found the difference in served text that a 3-row Gaussian check had
    passed)."""
    gen = torch.Generator().manual_seed(0)
    rows = weight.CHECK_ROWS * CHECK_BATCHES
    x = (F.silu(torch.randn(rows, weight.shape[1], generator=gen)) *
         torch.randn(rows, weight.shape[1], generator=gen)).to(torch.bfloat16)
    batches = [x[i:i + weight.CHECK_ROWS].clone() for i in range(0, rows, weight.CHECK_ROWS)]
    wholes = [weight.matmul(b) for b in batches]
    if not all(torch.equal(weight.matmul(b[:m].clone()), whole[:m])
               for b, whole in zip(batches, wholes) for m in range(2, weight.CHECK_ROWS)):
        logger.warning("oneDNN's bf16 rows depend on their batch for a %s weight at %d threads: that shape "
                       "stays on the kernels", "x".join(map(str, weight.shape)), torch.get_num_threads())
        return None
    for mode in ("exact", "pad"):
        weight.pad_single_row = mode == "pad"
        if all(torch.equal(weight.matmul(b[i:i + 1].clone()), whole[i:i + 1])
               for b, whole in zip(batches, wholes) for i in range(weight.CHECK_ROWS)):
            return mode
    logger.warning("oneDNN's bf16 single rows differ from a batch's for a %s weight at %d threads, even "
                   "padded: that shape stays on the kernels", "x".join(map(str, weight.shape)),
                   torch.get_num_threads())
    return None


Weight = torch.Tensor | Int8Weight | PackedBF16Weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` in the model dtype; returns ``[M, N]`` in ``x.dtype``."""
    if isinstance(weight, PackedBF16Weight):
        y = weight.matmul(x)
        return (y if bias is None else y + bias).to(x.dtype)
    kernels = gemv_kernels() if x.device.type == "cpu" and x.shape[0] <= SMALL_BATCH_ROWS else None
    threaded = kernels is not None and x.dtype == torch.bfloat16 and _threads_beat_kernels()
    if threaded and isinstance(weight, Int8Weight):
        y = weight.int8pack_mm(x)
    elif kernels is not None and isinstance(weight, Int8Weight):
        y = kernels.int8(x.to(torch.float32).contiguous(), weight.qweight, weight.scale)
    elif (kernels is not None and not isinstance(weight, Int8Weight) and weight.dtype == torch.bfloat16
          and weight.is_contiguous()):
        if kernels.native_bf16 and x.dtype == torch.bfloat16:
            if threaded or x.shape[0] >= AMX_ONEDNN_ROWS and _cpu_has_amx():
                return F.linear(x, weight, bias)
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


def _threads_beat_kernels() -> bool:
    """True with more than one torch thread on an AVX-512 CPU: the kernels are single-threaded, while torch's
    bf16 products (oneDNN) and its int8 weight-only product with bf16 activations (``_weight_int8pack_mm``)
    use every thread; measured here at 2 threads, a SmolLM2 decode step's int8 products took 9.5 ms against
    the kernel's 13.8 (1 row) and 44 against 84 (16 rows); on the AMX host at 8 threads bf16 9.5 against 19.2
    ms and int8 4.2 against 13.1 (1 row). With float32 activations ``_weight_int8pack_mm`` runs a scalar loop
    (111 ms at 1 row), so ``float32`` models keep the kernel. Read per call (``torch.get_num_threads`` is
    cheap): an engine sets its count at start."""
    return torch.get_num_threads() > 1 and not _cpu_lacks_bf16_gemm()


def _widen_bf16(x: torch.Tensor) -> bool:
    # without AVX-512 (no native bf16 in oneDNN), torch's bf16 GEMM is slower than fp32's: widen instead
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _cpu_lacks_bf16_gemm()


@functools.cache
def _cpu_lacks_bf16_gemm() -> bool:
    return torch.backends.cpu.get_cpu_capability() != "AVX512"


def embedding(token_ids: torch.Tensor, weight: torch.Tensor | Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``token_ids`` (``[T]`` int64) of an embedding ``[V, H]``, as ``[T, H]`` in ``dtype``."""
    if isinstance(weight, Int8Weight):
        return weight.dequantize(dtype, token_ids)
    return F.embedding(token_ids, weight)


def weight_bytes(weight: Weight) -> int:
    """Bytes a full product with ``weight`` reads (int8 rows plus their scales; 2 per packed bf16 weight)."""
    if isinstance(weight, PackedBF16Weight):
        return weight.shape.numel() * 2
    if isinstance(weight, Int8Weight):
        return weight.qweight.numel() + weight.scale.numel() * weight.scale.element_size()
    return weight.numel() * weight.element_size()
