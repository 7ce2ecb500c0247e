"""The ``TokenDispatcher`` seam: moving each token to the experts it was routed to, and their outputs back.

An MoE layer of ``num_experts`` routed experts, spread over ``ep`` ranks (expert parallelism; rank ``r`` holds
the contiguous experts ``[r * E / ep, (r + 1) * E / ep)``), runs per step:

1. the router gives every local token its ``topk_ids`` / ``topk_weights`` (``engine.model.moe_routing``);
2. ``dispatch`` hands each of this rank's experts the token rows routed to it, from every rank;
3. the layer runs each local expert on its rows (one SwiGLU per expert);
4. ``combine`` sends the outputs back to the ranks the tokens came from and sums each token's
   ``top_k`` outputs, weighted, in token order.

Contract (every implementation)
- Caller: the MoE block's forward (``engine.model.moe.MoEBlock``), on the thread that runs the model (the
  engine thread; a rank process's main thread). Not thread-safe; one ``dispatch`` then one ``combine`` per
  MoE layer and step, never interleaved with another layer's.
- With ``ep > 1`` every rank of the group makes the same calls in the same order, every step, including a
  rank with no tokens (``T = 0``): dispatch and combine are collectives. A call that cannot complete raises
  ``DispatchError`` within the dispatcher's ``timeout_s``; it never hangs.
- ``dispatch(hidden [T, H], topk_ids [T, K] int64, topk_weights [T, K] float32)``: ``hidden`` in the model
  dtype, contiguous; ``topk_ids`` global expert ids in ``[0, num_experts)``, distinct within a row. Returns a
  ``Dispatched``: ``hidden`` ``[N, H]`` (model dtype) whose rows are grouped by local expert, ``counts[e]``
  rows for local expert ``e`` in order (an expert with no token gets 0 rows), and ``handle``, opaque.
  Within one expert the rows come from rank 0's tokens first, each rank's in token order (DeepEP's
  dispatcher keeps DeepEP's own order).
- ``combine(expert_outputs [N, H], handle)``: row ``i`` is the expert output of ``Dispatched.hidden`` row
  ``i``. Returns ``[T, H]`` in the model dtype: for token ``t``, ``sum_k topk_weights[t, k] * out(t, k)``,
  the products in float32 rounded to the model dtype as transformers' DeepSeek-V3 experts do, summed in
  ascending expert id (the reference's order; on the CPU ``index_add_`` adds rows in order, so
  ``LocalDispatcher`` and ``AllToAllDispatcher`` give identical bits; CUDA's atomic adds promise no order).
  Nothing is added for shared experts: the caller adds them.

Implementations: ``LocalDispatcher`` (ep = 1, no communication), ``AllToAllDispatcher``
(``torch.distributed.all_to_all_single``: gloo on the CPU, NCCL on GPUs; the reference, tested here with 2
gloo ranks), ``engine.model.deepep_dispatch.DeepEPDispatcher`` (DeepEP, GPU only, not run here).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class DispatchError(RuntimeError):
    """A dispatch or combine did not complete (a peer rank died, timed out, or sent inconsistent counts).

    Attributes:
        op: ``"dispatch"`` or ``"combine"``.
        reason: what happened.
    """

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"MoE {op}: {reason}")
        self.op = op
        self.reason = reason


@dataclass
class Dispatched:
    """What ``dispatch`` returns.

    Attributes:
        hidden: ``[N, H]`` model dtype: every local expert's token rows, grouped by local expert.
        counts: ``[num_local_experts]`` rows per local expert, in order (sum ``N``).
        handle: what ``combine`` needs; opaque to the caller.
    """

    hidden: torch.Tensor
    counts: list[int]
    handle: Any

    def per_expert(self) -> list[torch.Tensor]:
        """``hidden`` split into each local expert's rows (views)."""
        return list(self.hidden.split(self.counts))


class TokenDispatcher(ABC):
    """Moves tokens to their experts and back (module docstring: the contract).

    Attributes:
        num_experts: routed experts of the layer, all ranks together.
        rank, ep_size: this rank of the expert-parallel group.
        local_experts: the global ids this rank holds (contiguous).
    """

    def __init__(self, num_experts: int, rank: int = 0, ep_size: int = 1) -> None:
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"expert_parallel_size={ep_size} does not divide the {num_experts} experts")
        if not 0 <= rank < ep_size:
            raise ValueError(f"rank {rank} outside [0, {ep_size})")
        self.num_experts = num_experts
        self.rank = rank
        self.ep_size = ep_size
        per_rank = num_experts // ep_size
        self.local_experts = range(rank * per_rank, (rank + 1) * per_rank)

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> Dispatched:
        """Hand each local expert its rows (contract in the module docstring).

        Raises:
            DispatchError: the exchange failed or timed out (``ep > 1``).
        """

    @abstractmethod
    def combine(self, expert_outputs: torch.Tensor, handle: Any) -> torch.Tensor:
        """The weighted sum of each token's expert outputs, ``[T, H]``, in token order (module docstring).

        Raises:
            DispatchError: the exchange failed or timed out (``ep > 1``).
        """


@dataclass
class _SendPlan:
    """One rank's (token, k) pairs sorted by global expert id (stable: token order within an expert)."""

    order: torch.Tensor        # [T*K] int64: flat (token * K + k) indices in expert order
    tokens: torch.Tensor       # [T*K] int64: the token of each sorted pair
    weights: torch.Tensor      # [T*K] float32: its weight
    expert_counts: torch.Tensor  # [num_experts] int64: pairs per global expert
    num_tokens: int


def _plan(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> _SendPlan:
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = torch.bincount(flat, minlength=num_experts)
    return _SendPlan(order, torch.div(order, int(topk_ids.shape[1]), rounding_mode="floor"),
                     topk_weights.reshape(-1)[order].float(), counts, int(topk_ids.shape[0]))


def _weighted_sum(rows: torch.Tensor, plan: _SendPlan) -> torch.Tensor:
    """``[T, H]``: each row times its pair's weight (fp32 product rounded to the rows' dtype, as
    transformers' experts do), summed into its token in expert order."""
    out = torch.zeros(plan.num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    weighted = (rows.float() * plan.weights[:, None]).to(rows.dtype)
    return out.index_add_(0, plan.tokens, weighted)


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank (``ep = 1``): a sort by expert and a gather; no communication."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> Dispatched:
        plan = _plan(topk_ids, topk_weights, self.num_experts)
        return Dispatched(hidden[plan.tokens], plan.expert_counts.tolist(), plan)

    def combine(self, expert_outputs: torch.Tensor, handle: _SendPlan) -> torch.Tensor:
        return _weighted_sum(expert_outputs, handle)


@dataclass
class _AllToAllHandle:
    plan: _SendPlan
    send_splits: list[int]      # rows this rank sent to each rank
    recv_splits: list[int]      # rows it received from each rank
    regroup: torch.Tensor       # [N] int64: received row (source-major) of each expert-grouped row


class AllToAllDispatcher(TokenDispatcher):
    """Expert parallelism over a ``torch.distributed`` group with ``all_to_all_single`` (gloo on the CPU, NCCL
    on GPUs): the reference implementation.

    ``dispatch``: the per-expert counts first (an all-to-all of ``[num_experts]`` int64: each rank learns
    how many rows every source sends each of its experts), then the token rows (one all-to-all of
    ``[rows, H]`` with uneven splits); the received rows, ordered by source rank, are regrouped by local
    expert. ``combine``: the outputs go back (the inverse all-to-all) and the source weights and sums them.
    The weights never travel: each rank keeps its tokens' weights.

    Args:
        num_experts: routed experts in all.
        group: the expert-parallel process group (its rank and size are this rank's and ``ep``).
        timeout_s: how long one collective may wait before ``DispatchError``.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup, timeout_s: float = 30.0) -> None:
        # the group's own rank and size: a group built from a store (engine.parallel.torch_comm) is not
        # registered with torch.distributed's default world, which dist.get_rank(group) needs
        super().__init__(num_experts, group.rank(), group.size())
        self.group = group
        self._timeout = timedelta(seconds=timeout_s)

    def _all_to_all(self, op: str, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                    in_splits: list[int] | None) -> None:
        try:
            # the group's own call (what dist.all_to_all_single makes): it also takes a backend group built
            # from a store (ProcessGroupGloo / ProcessGroupNCCL), which has no all_to_all_single
            work = self.group.alltoall_base(out, inp, out_splits or [], in_splits or [],
                                            dist.AllToAllOptions())
            done = work.wait(self._timeout)
        except RuntimeError as e:   # gloo: a peer's connection closed, or its timeout
            raise DispatchError(op, str(e).splitlines()[0]) from None
        if not done:
            raise DispatchError(op, f"all_to_all_single did not complete in {self._timeout}")

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> Dispatched:
        plan = _plan(topk_ids, topk_weights, self.num_experts)
        per_rank = len(self.local_experts)
        recv_counts = torch.empty_like(plan.expert_counts)   # [ep * per_rank]: source-major
        self._all_to_all("dispatch", recv_counts, plan.expert_counts, None, None)
        send_splits = plan.expert_counts.view(self.ep_size, per_rank).sum(dim=1).tolist()
        by_source = recv_counts.view(self.ep_size, per_rank)   # [source rank, local expert]
        recv_splits = by_source.sum(dim=1).tolist()
        received = hidden.new_empty(sum(recv_splits), hidden.shape[1])
        self._all_to_all("dispatch", received, hidden[plan.tokens].contiguous(), recv_splits, send_splits)
        regroup = _regroup_index(by_source)
        counts = by_source.sum(dim=0).tolist()
        return Dispatched(received[regroup], counts, _AllToAllHandle(plan, send_splits, recv_splits, regroup))

    def combine(self, expert_outputs: torch.Tensor, handle: _AllToAllHandle) -> torch.Tensor:
        source_major = torch.empty_like(expert_outputs)
        source_major[handle.regroup] = expert_outputs
        back = expert_outputs.new_empty(sum(handle.send_splits), expert_outputs.shape[1])
        self._all_to_all("combine", back, source_major, handle.send_splits, handle.recv_splits)
        return _weighted_sum(back, handle.plan)


def _regroup_index(by_source: torch.Tensor) -> torch.Tensor:
    """For received rows laid out source-major (``by_source[s, e]`` rows of source ``s`` for local expert
    ``e``, sources in order, experts in order within a source), the received row of each row of the
    expert-major order (expert ``e``'s rows from source 0 first): ``[N]`` int64."""
    sources, experts = by_source.shape
    expert_ids = torch.arange(experts, device=by_source.device).repeat(sources)    # of each (s, e) block
    expert_of_row = expert_ids.repeat_interleave(by_source.reshape(-1))
    return torch.sort(expert_of_row, stable=True)[1]   # stable: sources stay in order within an expert
