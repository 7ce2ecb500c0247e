"""``DeepEPDispatcher``: the ``TokenDispatcher`` seam over DeepEP (deepseek-ai/DeepEP, ``deep_ep.Buffer``).

GPU only (NVLink within a node, RDMA with NVSHMEM/IBGDA across nodes), written against DeepEP's public Python
API and **not run in this project** (no GPU, no ``deep_ep`` here): ``deep_ep`` is imported when the
dispatcher is built, never at module import, so this module imports everywhere.

Two modes, as SGLang's prefill/decode disaggregation uses them (its ``DeepEPMode`` "auto"):

- ``"normal"`` (throughput; prefill and colocated-prefill steps): ``Buffer.get_dispatch_layout`` then
  ``Buffer.dispatch``; each token arrives once per rank that holds one of its experts, with
  ``recv_topk_idx`` (this rank's local expert ids, -1 for experts elsewhere) and ``recv_topk_weights``. Our
  ``dispatch`` expands those into per-local-expert rows; ``combine`` weights and sums each received token's
  local expert outputs, then ``Buffer.combine`` (an unweighted sum over ranks) brings the token home.
- ``"low_latency"`` (decode: few tokens, CUDA-graph friendly): ``Buffer.low_latency_dispatch`` gives
  ``[num_local_experts, max_tokens * ep, H]`` and a count per expert; ``Buffer.low_latency_combine`` takes the
  outputs in that layout with the tokens' ``topk_idx``/``topk_weights`` and does the weighted sum itself.

``mode_for_role`` picks the mode from the instance's role (``EngineConfig.mode``): a decode instance runs low
latency, prefill and colocated instances normal; ``mode="..."`` overrides it. A buffer is built for one mode
(DeepEP asks for ``low_latency_mode`` and its buffer sizes at construction). Shapes, dtypes and threads as the
seam's contract (``engine.model.moe_dispatch``); DeepEP wants bfloat16 hidden states, so other dtypes are
converted on the way in and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.model.moe_dispatch import Dispatched, DispatchError, TokenDispatcher

MODES: tuple[str, ...] = ("normal", "low_latency")
#: DeepEP's own example sizes for an NVLink buffer (prefill) and the low-latency RDMA buffer's token bound
DEFAULT_NVL_BYTES = 1 << 30
DEFAULT_MAX_DISPATCH_TOKENS = 128


def mode_for_role(role: str) -> str:
    """``"low_latency"`` for a decode instance, ``"normal"`` for prefill and colocated ones."""
    return "low_latency" if role == "decode" else "normal"


@dataclass
class _NormalHandle:
    deep_handle: Any
    rows: torch.Tensor       # [N] int64: the received token of each expert-grouped row
    weights: torch.Tensor    # [N] float32: its weight
    num_received: int
    dtype: torch.dtype


@dataclass
class _LowLatencyHandle:
    deep_handle: Any
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    counts: list[int]
    shape: torch.Size        # [num_local_experts, max_tokens * ep, H]
    dtype: torch.dtype


class DeepEPDispatcher(TokenDispatcher):
    """DeepEP's dispatch/combine behind the seam (GPU only; not run here).

    Args:
        num_experts: routed experts in all.
        group: the expert-parallel process group (NCCL), one rank per GPU.
        role: the instance's role (``"prefill"``, ``"decode"``, ``"colocated"``): picks the mode.
        mode: ``"normal"`` or ``"low_latency"``; None: ``mode_for_role(role)``.
        hidden: the model's hidden size (sizes the low-latency buffer).
        num_nvl_bytes: NVLink buffer bytes for normal mode.
        max_dispatch_tokens: low latency: most tokens one rank dispatches per step (every rank the same).

    Raises:
        ImportError: ``deep_ep`` is not installed.
        ValueError: an unknown mode, or no CUDA device.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup, role: str, mode: str | None = None,
                 hidden: int = 7168, num_nvl_bytes: int = DEFAULT_NVL_BYTES,
                 max_dispatch_tokens: int = DEFAULT_MAX_DISPATCH_TOKENS) -> None:
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        self.mode = mode or mode_for_role(role)
        if self.mode not in MODES:
            raise ValueError(f"DeepEP mode must be one of {MODES}, got {self.mode!r}")
        if not torch.cuda.is_available():
            raise ValueError("DeepEPDispatcher needs CUDA devices (DeepEP is GPU only)")
        import deep_ep  # GPU only; see the module docstring

        self.max_dispatch_tokens = max_dispatch_tokens
        if self.mode == "normal":
            self.buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=0)
        else:
            rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_dispatch_tokens, hidden, self.ep_size,
                                                                 num_experts)
            self.buffer = deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                                         num_qps_per_rank=len(self.local_experts))

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 recv_counts: torch.Tensor | None = None) -> Dispatched:
        # recv_counts is not used: DeepEP's own layout step (notify) exchanges the counts
        if self.mode == "normal":
            return self._dispatch_normal(hidden, topk_ids, topk_weights.float())
        return self._dispatch_low_latency(hidden, topk_ids, topk_weights.float())

    def combine(self, expert_outputs: torch.Tensor, handle: Any) -> torch.Tensor:
        if isinstance(handle, _NormalHandle):
            return self._combine_normal(expert_outputs, handle)
        return self._combine_low_latency(expert_outputs, handle)

    def _dispatch_normal(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor) -> Dispatched:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_ids,
                                                                                           self.num_experts)
        recv_x, recv_ids, recv_weights, _, deep_handle, _ = self.buffer.dispatch(
            hidden.to(torch.bfloat16), topk_idx=topk_ids, topk_weights=topk_weights,
            num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        flat = recv_ids.reshape(-1)   # local expert ids, -1 where the expert lives on another rank
        local = torch.nonzero(flat >= 0).squeeze(1)
        order = local[torch.sort(flat[local], stable=True)[1]]
        rows = torch.div(order, recv_ids.shape[1], rounding_mode="floor")
        counts = torch.bincount(flat[order], minlength=len(self.local_experts)).tolist()
        handle = _NormalHandle(deep_handle, rows, recv_weights.reshape(-1)[order].float(), recv_x.shape[0],
                               hidden.dtype)
        return Dispatched(recv_x[rows].to(hidden.dtype), counts, handle)

    def _combine_normal(self, expert_outputs: torch.Tensor, handle: _NormalHandle) -> torch.Tensor:
        partial = torch.zeros(handle.num_received, expert_outputs.shape[1], dtype=torch.float32,
                              device=expert_outputs.device)
        partial.index_add_(0, handle.rows, expert_outputs.float() * handle.weights[:, None])
        combined, _, _ = self.buffer.combine(partial.to(torch.bfloat16), handle.deep_handle)
        return combined.to(handle.dtype)

    def _dispatch_low_latency(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                              topk_weights: torch.Tensor) -> Dispatched:
        if hidden.shape[0] > self.max_dispatch_tokens:
            raise DispatchError("dispatch", f"{hidden.shape[0]} tokens exceed max_dispatch_tokens="
                                            f"{self.max_dispatch_tokens} of the low-latency buffer")
        recv_x, recv_count, deep_handle, _, _ = self.buffer.low_latency_dispatch(
            hidden.to(torch.bfloat16), topk_ids, self.max_dispatch_tokens, self.num_experts, use_fp8=False)
        counts = recv_count.tolist()
        rows = torch.cat([recv_x[e, :n] for e, n in enumerate(counts)])
        handle = _LowLatencyHandle(deep_handle, topk_ids, topk_weights, counts, recv_x.shape, hidden.dtype)
        return Dispatched(rows.to(hidden.dtype), counts, handle)

    def _combine_low_latency(self, expert_outputs: torch.Tensor, handle: _LowLatencyHandle) -> torch.Tensor:
        packed = expert_outputs.new_zeros(handle.shape, dtype=torch.bfloat16)
        for e, rows in enumerate(expert_outputs.split(handle.counts)):
            packed[e, :rows.shape[0]] = rows
        combined, _, _ = self.buffer.low_latency_combine(packed, handle.topk_ids, handle.topk_weights,
                                                         handle.deep_handle)
        return combined.to(handle.dtype)
