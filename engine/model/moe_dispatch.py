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
  ``Dispatched``: ``hidden`` ``[N, H]`` (model dtype) in contiguous ``blocks`` of one local expert each
  (``(local expert, start, stop)``, covering every row once; ``None``: grouped by local expert in order),
  ``counts[e]`` rows for local expert ``e`` in all (an expert with no token gets 0 rows), and ``handle``,
  opaque. ``per_expert()`` gives each local expert's rows: rank 0's tokens first, each rank's in token order
  (DeepEP's dispatcher keeps DeepEP's own order).
- ``combine(expert_outputs [N, H], handle)``: row ``i`` is the expert output of ``Dispatched.hidden`` row
  ``i``. Returns ``[T, H]`` in the model dtype: for token ``t``, ``sum_k topk_weights[t, k] * out(t, k)``,
  the products in float32 rounded to the model dtype as transformers' DeepSeek-V3 experts do, summed in
  ascending expert id (the reference's order; on the CPU ``index_add_`` adds rows in order, so
  ``LocalDispatcher`` and ``AllToAllDispatcher`` give identical bits; CUDA's atomic adds promise no order).
  Nothing is added for shared experts: the caller adds them. ``expert_outputs`` is consumed: an
  implementation may overwrite it (fp32 rows are weighted where they are).

Implementations: ``LocalDispatcher`` (ep = 1, no communication), ``AllToAllDispatcher``
(``torch.distributed.all_to_all_single``: gloo on the CPU, NCCL on GPUs; the reference, tested here with 2
gloo ranks), ``engine.model.shm_dispatch.SharedMemoryDispatcher`` (CPU ranks of one host, through their
collectives' shared region: what an expert-parallel engine uses there by default),
``engine.model.deepep_dispatch.DeepEPDispatcher`` (DeepEP, GPU only, not run here).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.communicator import transport_reason


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
        hidden: ``[N, H]`` model dtype: every local expert's token rows, in ``blocks``.
        counts: ``[num_local_experts]`` rows per local expert, in order (sum ``N``).
        handle: what ``combine`` needs; opaque to the caller.
        blocks: ``(local expert, start, stop)`` row ranges of ``hidden``, each of one expert, covering every
            row once, listed by source rank (rank 0's first; the rows themselves may lie in another order);
            None: ``hidden`` is grouped by local expert in order (``counts``). An expert's rows may lie in
            several blocks (the all-to-all leaves them by source rank).
    """

    hidden: torch.Tensor
    counts: list[int]
    handle: Any
    blocks: list[tuple[int, int, int]] | None = None

    def expert_blocks(self) -> list[tuple[int, int, int]]:
        """``blocks``, or for grouped rows one block per local expert (empty ones included)."""
        if self.blocks is not None:
            return self.blocks
        starts = [0]
        for c in self.counts:
            starts.append(starts[-1] + c)
        return [(e, starts[e], starts[e + 1]) for e in range(len(self.counts))]

    def per_expert(self) -> list[torch.Tensor]:
        """Each local expert's rows, in order (views when grouped; else a copy joining its blocks)."""
        if self.blocks is None:
            return list(torch.split(self.hidden, self.counts))
        parts: list[list[torch.Tensor]] = [[] for _ in self.counts]
        for e, start, stop in self.blocks:
            parts[e].append(self.hidden[start:stop])
        return [torch.cat(p) if p else self.hidden[:0] for p in parts]


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
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 recv_counts: torch.Tensor | None = None) -> Dispatched:
        """Hand each local expert its rows (contract in the module docstring).

        Args:
            recv_counts: ``[ep, num_local_experts]`` int64 (CPU): the rows every source rank sends each of
                this rank's experts, when the caller already knows them (every rank routed every rank's
                tokens: ``counts_by_source``); an implementation may then skip exchanging them. Every rank of
                the group passes it or none does, and the counts must be what the sources send (else the
                exchange fails or times out). Ignored where nothing is exchanged.

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
class SendPlan:
    """One rank's (token, k) pairs sorted by global expert id (stable: token order within an expert)."""

    order: torch.Tensor        # [T*K] int64: flat (token * K + k) indices in expert order
    tokens: torch.Tensor       # [T*K] int64: the token of each sorted pair
    weights: torch.Tensor      # [T*K] float32: its weight
    expert_counts: torch.Tensor  # [num_experts] int64: pairs per global expert
    num_tokens: int


def plan_sends(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> SendPlan:
    """The ``SendPlan`` of ``topk_ids`` ``[T, K]`` int64 / ``topk_weights`` ``[T, K]``: a stable sort of the
    ``T * K`` pairs by expert id, each pair's token and float32 weight, and the pairs per expert."""
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = torch.bincount(flat, minlength=num_experts)
    return SendPlan(order, torch.div(order, int(topk_ids.shape[1]), rounding_mode="floor"),
                    topk_weights.reshape(-1)[order].float(), counts, int(topk_ids.shape[0]))


def weighted(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[n, H]`` times ``weights`` ``[n]`` float32, the fp32 product rounded to the rows' dtype (as
    transformers' experts do); fp32 ``rows`` are scaled where they are (the same products, no new tensor)."""
    if rows.dtype == torch.float32:
        return rows.mul_(weights[:, None])
    return (rows.float() * weights[:, None]).to(rows.dtype)


def weighted_sum(rows: torch.Tensor, plan: SendPlan) -> torch.Tensor:
    """``[T, H]``: each row of ``rows`` (the plan's order) weighted and summed into its token, in the plan's
    order (ascending expert id per token)."""
    out = torch.zeros(plan.num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, plan.tokens, weighted(rows, plan.weights))


class LocalDispatcher(TokenDispatcher):
    """Every expert on this rank (``ep = 1``): a sort by expert and a gather; no communication."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 recv_counts: torch.Tensor | None = None) -> Dispatched:
        plan = plan_sends(topk_ids, topk_weights, self.num_experts)
        return Dispatched(hidden[plan.tokens], plan.expert_counts.tolist(), plan)

    def combine(self, expert_outputs: torch.Tensor, handle: SendPlan) -> torch.Tensor:
        return weighted_sum(expert_outputs, handle)


class KeptRows:
    """Row buffers kept between calls by name, grown as needed (a dispatcher's received and sent rows): a
    fresh multi-megabyte tensor per call is a fresh memory mapping whose pages fault in on first touch, which
    cost more than the copies themselves (``AllToAllDispatcher``'s docstring has the figures)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}   # name -> flat storage

    def __call__(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[rows, like.shape[1]]`` tensor of ``like``'s dtype and device over the kept buffer ``name``
        (contents undefined; valid until the next call for ``name``), grown to at least twice what it held
        when too small."""
        need = rows * like.shape[1]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(need, 2 * (buf.numel() if buf is not None else 0)), dtype=like.dtype,
                              device=like.device)
            self._buffers[name] = buf
        return buf[:need].view(rows, like.shape[1])


@dataclass
class _AllToAllHandle:
    plan: SendPlan
    send_splits: list[int]      # rows this rank sent each rank (its own: the rows it kept)
    recv_splits: list[int]      # rows it received from each rank (its own: the rows it kept)
    own: slice                  # where its own rows lie in the plan's order (rows for its own experts)


class AllToAllDispatcher(TokenDispatcher):
    """Expert parallelism over a ``torch.distributed`` group with ``all_to_all_single`` (gloo on the CPU, NCCL
    on GPUs): the reference implementation.

    ``dispatch``: the per-expert counts first (an all-to-all of ``[num_experts]`` int64: each rank learns
    how many rows every source sends each of its experts; skipped when the caller passes them), then the
    token rows (one all-to-all of ``[rows, H]`` with uneven splits). The rows a rank routes to its own
    experts never enter the collective: the all-to-all carries the other ranks' rows only (its own split 0),
    and while it runs (gloo and NCCL run it on their own thread or stream) the rank copies its own rows
    straight to where they are received. The received rows stay where they landed, this rank's own first,
    then each other rank's by rank, each source's by local expert, described by ``Dispatched.blocks``: the
    experts run on each block, so no row is copied to group them and none back before ``combine``.
    ``combine``: the other ranks' outputs go back (the inverse all-to-all, straight from the caller's
    tensor); while they travel the rank weights its own outputs where they are (and sums them when its
    experts come first in expert order); then it sums the rest, each token's products in ascending expert
    id. The weights never travel: each rank keeps its tokens' weights.

    Why a rank's own rows bypass the collective: with routing spread evenly ``1 / ep`` of a layer's rows are
    a rank's own, and gloo's all-to-all moves them slowly. 2 ranks on this project's 2-core host, 7.3 MB
    each way to the other rank: 4.3 ms; with 7.3 MB of a rank's own beside them: 6.8 ms. An
    ``index_select`` of the same own rows takes ~0.4-0.6 ms, and runs while the other rows travel.

    The row buffers (what is sent, what is received) are kept between calls and grown as needed: a fresh
    multi-megabyte tensor per call is a fresh memory mapping whose pages fault in on first touch, which cost
    more than the copies themselves (a 3.7 MB row permutation: 550 us into a new tensor, 93 us into a kept
    one, on this project's 2-core host). So ``Dispatched.hidden`` is valid until the next ``dispatch``; what
    ``combine`` returns is the caller's own.

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
        self._rows = KeptRows()   # the row buffers, reused (see the class docstring)

    def _start(self, op: str, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
               in_splits: list[int] | None) -> dist.Work:
        try:
            # the group's own call (what dist.all_to_all_single makes): it also takes a backend group built
            # from a store (ProcessGroupGloo / ProcessGroupNCCL), which has no all_to_all_single
            return self.group.alltoall_base(out, inp, out_splits or [], in_splits or [],
                                            dist.AllToAllOptions())
        except RuntimeError as e:   # gloo: a peer's connection closed
            raise DispatchError(op, transport_reason(e)) from None

    def _wait(self, op: str, work: dist.Work) -> None:
        try:
            done = work.wait(self._timeout)
        except RuntimeError as e:   # gloo: a peer's connection closed, or its timeout
            raise DispatchError(op, transport_reason(e)) from None
        if not done:
            raise DispatchError(op, f"all_to_all_single did not complete in {self._timeout}")

    def _others(self, splits: list[int]) -> list[int]:
        """``splits`` with this rank's own entry 0 (what the all-to-all carries)."""
        return [0 if r == self.rank else n for r, n in enumerate(splits)]

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 recv_counts: torch.Tensor | None = None) -> Dispatched:
        plan = plan_sends(topk_ids, topk_weights, self.num_experts)
        per_rank = len(self.local_experts)
        if recv_counts is None:   # learn them: one all-to-all of [num_experts] int64, source-major
            exchanged = torch.empty_like(plan.expert_counts)
            self._wait("dispatch", self._start("dispatch", exchanged, plan.expert_counts, None, None))
            recv_counts = exchanged
        elif tuple(recv_counts.shape) != (self.ep_size, per_rank):
            raise ValueError(f"recv_counts of shape {tuple(recv_counts.shape)}, expected "
                             f"{(self.ep_size, per_rank)}")
        send_splits = plan.expert_counts.view(self.ep_size, per_rank).sum(dim=1).tolist()
        by_source = recv_counts.view(self.ep_size, per_rank)   # [source rank, local expert]
        recv_splits = by_source.sum(dim=1).tolist()
        if recv_splits[self.rank] != send_splits[self.rank]:
            raise ValueError(f"recv_counts give this rank {recv_splits[self.rank]} rows of its own, it "
                             f"routed {send_splits[self.rank]} to its experts")
        first = sum(send_splits[:self.rank])
        own = slice(first, first + send_splits[self.rank])
        mine = recv_splits[self.rank]
        received = self._rows("received", sum(recv_splits), hidden)
        work = None
        if self.ep_size > 1:
            others = torch.cat([plan.tokens[:own.start], plan.tokens[own.stop:]])
            send = torch.index_select(hidden, 0, others, out=self._rows("send", len(others), hidden))
            work = self._start("dispatch", received[mine:], send, self._others(recv_splits),
                               self._others(send_splits))
        torch.index_select(hidden, 0, plan.tokens[own], out=received[:mine])   # while the others travel
        if work is not None:
            self._wait("dispatch", work)
        counts = by_source.sum(dim=0).tolist()
        order = [self.rank] + [r for r in range(self.ep_size) if r != self.rank]
        return Dispatched(received, counts, _AllToAllHandle(plan, send_splits, recv_splits, own),
                          source_blocks(by_source.tolist(), order))

    def combine(self, expert_outputs: torch.Tensor, handle: _AllToAllHandle) -> torch.Tensor:
        plan, own = handle.plan, handle.own
        outputs = expert_outputs.contiguous()
        mine = handle.recv_splits[self.rank]
        back = self._rows("send", len(plan.tokens) - (own.stop - own.start), outputs)   # sent rows: done
        work = None
        if self.ep_size > 1:
            work = self._start("combine", back, outputs[mine:], self._others(handle.send_splits),
                               self._others(handle.recv_splits))
        # summed in the plan's order (ascending expert id per token), as LocalDispatcher sums: the rows for
        # lower ranks' experts, this rank's own, then higher ranks'. While the others' rows travel, this
        # rank's own are weighted, and summed too when they come first.
        out = torch.zeros(plan.num_tokens, outputs.shape[1], dtype=outputs.dtype, device=outputs.device)
        own_rows = weighted(outputs[:mine], plan.weights[own])
        if own.start == 0:
            out.index_add_(0, plan.tokens[own], own_rows)
        if work is not None:
            self._wait("combine", work)
        if own.start > 0:
            out.index_add_(0, plan.tokens[:own.start], weighted(back[:own.start], plan.weights[:own.start]))
            out.index_add_(0, plan.tokens[own], own_rows)
        if own.stop < len(plan.tokens):
            rest = slice(own.stop, len(plan.tokens))
            out.index_add_(0, plan.tokens[rest], weighted(back[own.start:], plan.weights[rest]))
        return out


def counts_by_source(topk_ids: torch.Tensor, token_splits: list[int], num_experts: int, rank: int,
                     ep_size: int) -> torch.Tensor:
    """What every source rank sends rank ``rank``'s experts, from the routing of every rank's tokens:
    ``topk_ids`` ``[T, K]`` int64, the tokens of rank ``s`` its ``token_splits[s]`` rows in rank order.
    Returns ``[ep_size, num_experts // ep_size]`` int64 (a ``recv_counts`` for
    ``TokenDispatcher.dispatch``)."""
    per_rank = num_experts // ep_size
    rows = []
    for ids in torch.split(topk_ids, token_splits):
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
        rows.append(counts[rank * per_rank:(rank + 1) * per_rank])
    return torch.stack(rows)


def source_blocks(by_source: list[list[int]], order: list[int]) -> list[tuple[int, int, int]]:
    """The blocks of rows received source-major (``by_source[s][e]`` rows of source ``s`` for local expert
    ``e``; sources in ``order``, experts in order within a source): ``(e, start, stop)`` each, listed by
    source rank (so that ``Dispatched.per_expert`` gives rank 0's rows first), empty ones left out."""
    start = 0
    found: dict[int, list[tuple[int, int, int]]] = {}
    for s in order:
        found[s] = []
        for e, n in enumerate(by_source[s]):
            if n:
                found[s].append((e, start, start + n))
            start += n
    return [b for s in sorted(found) for b in found[s]]
