"""Paged attention on CUDA with flashinfer (Ye et al. 2025, "FlashInfer"; API per docs.flashinfer.ai, v0.2+).

``prepare`` converts the batch's page tables into flashinfer's CSR page layout once per step (all int32:
``kv_indptr`` ``[num_seqs + 1]``, ``kv_indices`` ``[total_pages]``, ``kv_last_page_len`` ``[num_seqs]``) and
plans one wrapper: ``BatchDecodeWithPagedKVCacheWrapper`` when every sequence has one new token, otherwise
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (flashinfer aligns the causal mask bottom-right,
so a chunk attends to all cached tokens plus causally to itself; decode tokens in a mixed batch are chunks of
one token). ``forward`` writes K/V with ``index_copy_`` at the slot mapping, then runs the planned wrapper on
the layer's ``(K, V)`` pair, each ``[num_pages, num_kv_heads, page_size, head_dim]`` ("HND" layout, as our
pool inside a page: head-major, ``engine.kv_pool``), strided between pages and between heads; flashinfer's
``paged_kv_t`` takes the page, head and token strides from the tensors (``kv_strides``, flashinfer v0.2+).

flashinfer is imported lazily, so this module imports on machines without it or without CUDA. Its kernels need
fp16 or bf16 tensors; ``select_backend`` keeps fp32 models on the torch backend.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import AttentionBackend, write_kv_slots
from engine.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's documented default workspace size
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    """True when the ``flashinfer`` package is importable and CUDA is available."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@dataclass
class FlashInferMetadata:
    """One step's plan: which wrapper runs, and where K/V rows are written (``[num_tokens]`` int64 slots)."""

    slot_mapping: torch.Tensor
    wrapper: Any
    is_decode: bool


def _csr_pages(batch: ForwardBatch, page_size: int) -> tuple[list[int], list[int], list[int]]:
    indptr, indices, last_len = [0], [], []
    for seq_len, pages in zip(batch.seq_lens, batch.page_tables):
        needed = -(-seq_len // page_size)
        if len(pages) < needed:
            raise ValueError(f"page table of {len(pages)} pages too short for seq_len={seq_len}")
        indices.extend(pages[:needed])
        indptr.append(len(indices))
        last_len.append(seq_len - (needed - 1) * page_size)
    return indptr, indices, last_len


class FlashInferAttentionBackend(AttentionBackend):
    """flashinfer paged attention; one instance per model (it owns a workspace buffer and two wrappers).

    Args:
        device: the CUDA device of the model and the KV pool.
        num_heads, num_kv_heads, head_dim: attention shapes; set by ``bind`` when not given here.
        dtype: q/KV dtype (fp16 or bf16).

    Raises:
        ImportError: flashinfer is not installed (at construction, never at import of this module).
    """

    def __init__(self, device: torch.device, num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        import flashinfer

        self.device = device
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")

    def bind(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Record the model's attention shapes and dtype (the model calls this when it adopts the backend)."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"flashinfer needs fp16 or bf16, got {dtype}")
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype

    def prepare(self, batch: ForwardBatch, page_size: int) -> FlashInferMetadata:
        num_heads, num_kv_heads, head_dim = self.shape
        if not num_heads:
            raise ValueError("FlashInferAttentionBackend.bind() was not called")
        indptr, indices, last_len = _csr_pages(batch, page_size)
        kv_indptr = torch.tensor(indptr, dtype=torch.int32)  # host: plan() schedules on the CPU
        kv_indices = torch.tensor(indices, dtype=torch.int32, device=self.device)
        kv_last = torch.tensor(last_len, dtype=torch.int32)
        scale = head_dim ** -0.5
        if all(q == 1 for q in batch.query_lens):
            self._decode.plan(kv_indptr, kv_indices, kv_last, num_heads, num_kv_heads, head_dim, page_size,
                              pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype,
                              sm_scale=scale)
            return FlashInferMetadata(batch.slot_mapping, self._decode, True)
        qo_indptr = torch.tensor([0, *torch.tensor(batch.query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self._prefill.plan(qo_indptr, kv_indptr, kv_indices, kv_last, num_heads, num_kv_heads, head_dim,
                           page_size, causal=True, sm_scale=scale, q_data_type=self.dtype,
                           kv_data_type=self.dtype)
        return FlashInferMetadata(batch.slot_mapping, self._prefill, False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor,
                metadata: FlashInferMetadata, scale: float) -> torch.Tensor:
        """See ``AttentionBackend.forward``; ``scale`` must equal ``head_dim ** -0.5`` (fixed at plan
        time)."""
        num_tokens, num_heads, head_dim = q.shape
        write_kv_slots(layer_kv, metadata.slot_mapping, k, v)
        # each [num_pages, kv_heads, page_size, head_dim] ("HND"), strided between pages and heads
        kv_pair = (layer_kv[0].permute(0, 2, 1, 3), layer_kv[1].permute(0, 2, 1, 3))
        out = metadata.wrapper.run(q.contiguous(), kv_pair)  # [num_tokens, num_heads, head_dim]
        return out.reshape(num_tokens, num_heads * head_dim)
