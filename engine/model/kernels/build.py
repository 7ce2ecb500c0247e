"""Build ``gemv_avx2.c`` once per source version into the model cache and call it through ctypes.

Why a kernel of our own: on AVX2-only CPUs (no AVX-512, no AMX) torch's CPU paths for a one-row product
(``F.linear`` in bf16, ``aten._weight_int8pack_mm``) are bound by their conversion loops, not by memory, and
oneDNN's prepacked bf16 weights (``mkldnn._reorder_linear_weight``) refuse to run without AVX-512 (bf16
``F.linear`` at one row is only ~1.4x fp32's there, where the kernel is ~1.7x). On CPUs with AVX512_BF16 the
library's ``gemm_bf16_native`` multiplies bf16 activations by bf16 weights with ``vdpbf16ps``, in about half
the AVX2 loop's time at 16 rows; ``has_avx512_bf16`` tells whether it may run.
The library is compiled with the system C compiler (``cc``, ~1 s) into
``<cache root>/kernels/gemv_avx2-<source hash>.so``, written to a temporary name and renamed, so concurrent
builders never load a half-written file. ctypes releases the GIL for the call. ``build_library`` builds the
engine's other C files the same way (``engine/parallel/shm_sync.c``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("gemv_avx2.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3


class GemvKernels:
    """The entry points of the built library; every call is single-threaded and synchronous.

    Each computes ``y[M, N] = x[M, K] @ W[N, K].T`` (times ``scale[N]`` for int8) in float32 accumulation:
    ``bf16`` and ``int8`` with float32 ``x`` on AVX2 + FMA, ``bf16_native`` with bfloat16 ``x`` on
    AVX512_BF16.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        for fn in (library.gemv_bf16, library.gemv_int8, library.gemm_bf16_native):
            fn.argtypes = _ARGTYPES
            fn.restype = None
        library.has_avx512_bf16.restype = ctypes.c_int
        #: True where the CPU has AVX512_BF16 (``bf16_native`` may be called)
        self.native_bf16 = bool(library.has_avx512_bf16())

    def bf16(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` float32, ``weight`` ``[N, K]`` bfloat16, both contiguous -> ``[M, N]`` float32."""
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._lib.gemv_bf16(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), x.shape[0], weight.shape[0],
                            x.shape[1])
        return y

    def bf16_native(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` bfloat16, ``weight`` ``[N, K]`` bfloat16, both contiguous -> ``[M, N]`` float32,
        on AVX512_BF16's dot products (``native_bf16`` must be True). Raises ``RuntimeError`` otherwise."""
        if not self.native_bf16:
            raise RuntimeError("this CPU has no AVX512_BF16")
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._lib.gemm_bf16_native(x.data_ptr(), weight.data_ptr(), None, y.data_ptr(), x.shape[0],
                                   weight.shape[0], x.shape[1])
        return y

    def int8(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` float32, ``weight`` ``[N, K]`` int8, ``scale`` ``[N]`` float32, all contiguous ->
        ``[M, N]`` float32."""
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._lib.gemv_int8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), x.shape[0],
                            weight.shape[0], x.shape[1])
        return y


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build(target: Path, source: Path = _SOURCE, flags: tuple[str, ...] = _FLAGS) -> None:
    compiler = shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(source)], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """Compile the C file ``source`` with ``flags`` once per source version into
    ``<cache root>/kernels/<stem>-<hash>.so`` (as the gemv kernels are) and load it.

    Raises:
        OSError: no C compiler, or the library cannot be loaded.
        subprocess.SubprocessError: the compiler failed or took over 2 minutes.
    """
    from engine.model.loader import default_cache_root

    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    target = default_cache_root() / "kernels" / f"{source.stem}-{digest}.so"
    if not target.is_file():
        _build(target, source, flags)
    return ctypes.CDLL(str(target))


@functools.cache
def gemv_kernels() -> GemvKernels | None:
    """The built kernels, or None (logged once) when this CPU lacks AVX2/FMA or building fails; callers then
    use torch's own products. Thread-safe after the first call returns (the result is cached)."""
    if not _cpu_supported():
        logger.info("gemv kernels off: CPU capability %s lacks AVX2", torch.backends.cpu.get_cpu_capability())
        return None
    try:
        return GemvKernels(build_library(_SOURCE, _FLAGS))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("gemv kernels unavailable (%s); using torch's products", exc)
        return None
