"""Hand-written CPU kernels the engine builds at first use (``build.py``) and calls through ctypes."""

from engine.model.kernels.build import GemvKernels, gemv_kernels

__all__ = ["GemvKernels", "gemv_kernels"]
