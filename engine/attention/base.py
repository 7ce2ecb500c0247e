"""The attention seam: the model calls an ``AttentionBackend`` once per step (``prepare``) and once per layer.

Contract
- Caller: ``LlamaForCausalLM.forward``, on the engine thread.
- ``bind(...)`` runs once when a model adopts the backend.
- ``prepare(batch, page_size)`` runs once per step, before the first layer; it turns the batch's page tables,
  query/KV lengths and slot mapping into whatever index tensors the kernels need (kept in the returned
  metadata, reused by every layer). No side effects on the KV cache.
- ``forward(q, k, v, layer_kv, metadata, scale)`` runs once per layer: it first writes this step's ``k`` and
  ``v`` rows into ``layer_kv`` at ``batch.slot_mapping`` (side effect on the caller-owned KV pool), then
  attends every query token causally to its sequence's cached tokens plus the chunk's earlier tokens.
- Shapes: ``q`` ``[num_tokens, num_heads, head_dim]``; ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]``;
  ``layer_kv`` ``[2, num_pages, page_size, num_kv_heads, head_dim]`` (``kv_cache[layer]``, dim 0: 0 = K, 1 =
  V; a strided view of the page-major pool, so pages are not adjacent: never ``view`` it flat, index it by
  (page, offset) as ``write_kv_slots`` does); output ``[num_tokens, num_heads * head_dim]``. dtype: that of
  ``q`` (fp32 on CPU; fp16/bf16 on CUDA), ``k``, ``v`` and ``layer_kv`` share it. ``num_heads`` is a multiple
  of ``num_kv_heads`` (GQA).
- MLA (``forward_latent``, DeepSeek-V2/V3): ``layer_kv`` ``[1, num_pages, page_size, 1, latent_dim]`` holds
  one plane, the token's latent ``c_kv | k_pe``; attention runs in the latent space (the absorbed form: one
  KV head whose keys are the whole latent and whose values are its first ``value_dim`` elements). Backends
  without it raise ``NotImplementedError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.forward_batch import ForwardBatch


def write_kv_slots(layer_kv: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor | None) -> None:
    """Write this step's ``k``/``v`` rows (``[num_tokens, num_kv_heads, head_dim]``) into ``layer_kv``
    (``[2, num_pages, page_size, num_kv_heads, head_dim]``, strided) at the flat slots ``slot_mapping``
    (``[num_tokens]`` int64, ``page * page_size + offset``), in place. ``v`` None: a one-plane (MLA) pool,
    ``k`` the latent rows."""
    page_size = layer_kv.shape[2]
    index = (torch.div(slot_mapping, page_size, rounding_mode="floor"), slot_mapping % page_size)
    layer_kv[0].index_put_(index, k)
    if v is not None:
        layer_kv[1].index_put_(index, v)


class AttentionBackend(ABC):
    """Paged causal attention over a continuous batch (prefill chunks and decode tokens mixed)."""

    def bind(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:  # noqa: B027 - optional hook
        """Called once by the model that adopts this backend, before any step; backends that plan kernels
        ahead record the shapes here. Default: nothing to record.

        Raises:
            ValueError: the backend cannot run this dtype or shape.
        """

    @abstractmethod
    def prepare(self, batch: ForwardBatch, page_size: int) -> Any:
        """Build per-step metadata from ``batch``; called once per step before any layer.

        Args:
            batch: this step's inputs (``slot_mapping``, ``query_lens``, ``seq_lens``, ``page_tables``).
            page_size: tokens per KV page (``kv_cache.shape[3]``).

        Returns:
            Backend-specific metadata, passed unchanged to every ``forward`` of this step.

        Raises:
            ValueError: a page table too short for its ``seq_len``.
        """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                metadata: Any, scale: float) -> torch.Tensor:
        """Write ``k``/``v`` into ``layer_kv`` at the step's slots, then return the attention output.

        Args:
            q: ``[num_tokens, num_heads, head_dim]`` queries (RoPE applied).
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` this step's keys (RoPE applied) and values.
            layer_kv: ``[2, num_pages, page_size, num_kv_heads, head_dim]``, written in place.
            metadata: what ``prepare`` returned for this step.
            scale: softmax scale, usually ``head_dim ** -0.5``.

        Returns:
            ``[num_tokens, num_heads * head_dim]``, dtype of ``q``.
        """

    def forward_latent(self, q: torch.Tensor, latent: torch.Tensor, layer_kv: torch.Tensor, metadata: Any,
                       scale: float, value_dim: int) -> torch.Tensor:
        """MLA in the latent space: write ``latent`` into ``layer_kv`` at the step's slots, then attend every
        query head to the cached latents (keys: the whole latent; values: its first ``value_dim``
        elements), causally as ``forward``.

        Args:
            q: ``[num_tokens, num_heads, latent_dim]``: the absorbed query (``q_nope`` through ``W_UK``, then
                ``q_pe`` with RoPE).
            latent: ``[num_tokens, 1, latent_dim]``: ``c_kv`` (normed) then ``k_pe`` (RoPE applied).
            layer_kv: ``[1, num_pages, page_size, 1, latent_dim]``, written in place.
            metadata: what ``prepare`` returned for this step.
            scale: softmax scale (MLA: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
            value_dim: ``kv_lora_rank``.

        Returns:
            ``[num_tokens, num_heads * value_dim]``, dtype of ``q``: the latent outputs (``W_UV`` not
            applied).

        Raises:
            NotImplementedError: this backend has no MLA path.
        """
        raise NotImplementedError(f"{type(self).__name__} does not run MLA attention")
