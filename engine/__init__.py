"""Torch-only LLM engine: paged KV pool, continuous batching with chunked prefill, sampling, PD roles.

Public API (see docs/architecture.md, "Engine API"):
``LLMEngine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``, ``PrefillChunk``; errors in
``engine.errors``.
"""

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import PrefillChunk, RequestOutput, Reservation
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "PrefillChunk", "RequestOutput", "Reservation", "SamplingParams"]
