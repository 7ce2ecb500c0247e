"""``SharedMemoryDispatcher``: the MoE exchange between the CPU rank processes of one host, through the shared
region their collectives already use (``engine.parallel.shm.ShmCommunicator``).

Why: gloo moves a rank's rows over loopback TCP. On this project's 2-core host an ``AllToAllDispatcher``
exchange of DeepSeek-V3-sized rows (64 tokens per rank, top-8 of 256 experts, hidden 7168, fp32) took
12-15 ms, most of it in the kernel's socket copies, and made an EP=2 decode step of the tiny MoE model
2.0-2.6x slower than EP=1 (docs/benchmarks.md). Here every row crosses once, as a memory copy, and no
system call is made while the ranks are in step. DeepEP does the same between the GPUs of one node: a rank
writes into a buffer its peers read (NVLink there, a memfd here).

One exchange = one operation of the communicator (its sequence numbers, flags, abort word and timeout):

- **dispatch**: a rank writes its slot: a header of its per-expert row counts (``[num_experts]`` int64,
  ``HEADER_ALIGN``-aligned), then the rows for every other rank's experts, destination by destination in
  rank order (the plan's order: by expert id, each expert's rows in token order); its own experts' rows are
  not written. It publishes, waits for the others, reads every header (so it learns the counts without an
  exchange of their own: one operation whether or not ``recv_counts`` is passed) and copies the rows meant
  for its experts out of each peer's slot. Received layout: its own rows first, then each other rank's by
  rank, each source's by local expert (as ``AllToAllDispatcher``'s: ``Dispatched.blocks``).
- **combine**: a rank writes the outputs of every other rank's rows to its slot (source by source, as they
  were received) and publishes; it weights its own outputs meanwhile; then it reads its rows' outputs from
  each peer's slot, weighting them on the way into a kept buffer, closes the operation and sums, in the
  plan's order (ascending expert id per token): ``LocalDispatcher``'s bits, as ``AllToAllDispatcher``.

The slot (``ShmCommunicator.slot_bytes``) must hold one exchange: the header plus every row a rank sends in
either direction. ``engine.parallel.group`` sizes the region for the step's worst case
(``exchange_bytes``) and uses this dispatcher only when that fits its cap; a call that still exceeds the slot
aborts the group (so no rank waits for it) and raises ``DispatchError``.

Thread: the rank's model thread, as every ``TokenDispatcher`` and the communicator it shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.moe_dispatch import (
    Dispatched,
    DispatchError,
    KeptRows,
    SendPlan,
    TokenDispatcher,
    plan_sends,
    source_blocks,
    weighted,
)
from engine.parallel.communicator import CollectiveError
from engine.parallel.shm import ShmCommunicator

#: alignment of the rows after the counts header in a slot (a cache line)
HEADER_ALIGN = 64


def header_bytes(num_experts: int) -> int:
    """Bytes of a dispatch slot's counts header: ``num_experts`` int64, rounded up to ``HEADER_ALIGN``."""
    return -(-8 * num_experts // HEADER_ALIGN) * HEADER_ALIGN


def exchange_bytes(num_experts: int, top_k: int, hidden: int, itemsize: int, max_tokens: int) -> int:
    """The most one rank writes into its slot for one exchange when a step holds at most ``max_tokens``
    tokens over all ranks: the header plus ``max_tokens * top_k`` rows of ``hidden`` values of ``itemsize``
    bytes (a rank sends at most every routed row of the step's tokens in one direction)."""
    return header_bytes(num_experts) + max_tokens * top_k * hidden * itemsize


@dataclass
class _ShmHandle:
    plan: SendPlan
    own: slice                  # where this rank's own rows lie in the plan's order
    sent: list[list[int]]       # [source][destination]: rows the source routed to the destination's experts


class SharedMemoryDispatcher(TokenDispatcher):
    """Expert parallelism between CPU ranks of one host over a ``ShmCommunicator`` (module docstring).

    Args:
        num_experts: routed experts in all.
        comm: this rank's communicator (its rank and size are the expert-parallel group's); the dispatcher
            makes its operations between the model's other collectives, as every rank does.

    ``Dispatched.hidden`` is valid until the next ``dispatch``; what ``combine`` returns is the caller's own.
    Errors: ``DispatchError`` when the group was aborted or a peer did not reach the exchange within the
    communicator's ``timeout_s``, or an exchange exceeds the slot; ``ValueError`` for a ``recv_counts`` of
    the wrong shape.
    """

    def __init__(self, num_experts: int, comm: ShmCommunicator) -> None:
        super().__init__(num_experts, comm.rank, comm.world_size)
        self.comm = comm
        self._header = header_bytes(num_experts)
        self._rows = KeptRows()

    def _slot_rows(self, slot: torch.Tensor, offset: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        """``[rows, H]`` of ``like``'s dtype over ``slot`` from byte ``offset``."""
        width = like.shape[1]
        nbytes = rows * width * like.element_size()
        return slot[offset:offset + nbytes].view(like.dtype).view(rows, width)

    def _check_fits(self, op: str, nbytes: int) -> None:
        if nbytes > self.comm.slot_bytes:
            reason = (f"{nbytes} bytes do not fit the shared slot of {self.comm.slot_bytes} "
                      "(more tokens in one step than the region was sized for)")
            self.comm.abort(f"rank {self.rank}: MoE {op}: {reason}")
            raise DispatchError(op, reason)

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 recv_counts: torch.Tensor | None = None) -> Dispatched:
        r, ep, per_rank = self.rank, self.ep_size, len(self.local_experts)
        if recv_counts is not None and tuple(recv_counts.shape) != (ep, per_rank):
            raise ValueError(f"recv_counts of shape {tuple(recv_counts.shape)}, expected {(ep, per_rank)}")
        plan = plan_sends(topk_ids, topk_weights, self.num_experts)
        send_splits = plan.expert_counts.view(ep, per_rank).sum(dim=1).tolist()
        first = sum(send_splits[:r])
        own = slice(first, first + send_splits[r])
        others = torch.cat([plan.tokens[:own.start], plan.tokens[own.stop:]])
        row_bytes = hidden.shape[1] * hidden.element_size()
        self._check_fits("dispatch", self._header + len(others) * row_bytes)
        comm, e = self.comm, self.num_experts
        with comm.timer("moe_dispatch", len(others) * row_bytes) as timer:
            try:
                seq = comm.open_operation("moe_dispatch", timer)
                slot = comm.slot(r, seq)
                slot[:8 * e].view(torch.int64).copy_(plan.expert_counts)
                rows = self._slot_rows(slot, self._header, len(others), hidden)
                torch.index_select(hidden, 0, others, out=rows)
                comm.publish(seq)
                comm.wait_published("moe_dispatch", seq, timer)
                slots = [comm.slot(s, seq) for s in range(ep)]
                counts = comm.slot_heads(seq, torch.int64, e).clone()   # [source, expert]: every header
                sent = counts.view(ep, ep, per_rank).sum(dim=2).tolist()   # [source][destination] rows
                recv = [sent[s][r] for s in range(ep)]
                received = self._rows("received", sum(recv), hidden)
                at = recv[r]   # this rank's own rows first (copied below, after the operation is closed)
                for s in range(ep):
                    if s != r and recv[s]:
                        before = sum(sent[s][d] for d in range(r) if d != s)   # rows s wrote ahead of ours
                        part = self._slot_rows(slots[s], self._header, before + recv[s], hidden)[before:]
                        received[at:at + recv[s]].copy_(part)
                    at += recv[s] if s != r else 0
                comm.close_operation(seq)
            except CollectiveError as err:
                raise DispatchError("dispatch", err.reason) from None
        torch.index_select(hidden, 0, plan.tokens[own], out=received[:recv[r]])
        by_source = counts[:, r * per_rank:(r + 1) * per_rank]   # [source rank, local expert]
        order = [r] + [s for s in range(ep) if s != r]
        return Dispatched(received, by_source.sum(dim=0).tolist(), _ShmHandle(plan, own, sent),
                          source_blocks(by_source.tolist(), order))

    def combine(self, expert_outputs: torch.Tensor, handle: _ShmHandle) -> torch.Tensor:
        plan, own, sent = handle.plan, handle.own, handle.sent
        r, ep = self.rank, self.ep_size
        outputs = expert_outputs.contiguous()
        mine = sent[r][r]
        row_bytes = outputs.shape[1] * outputs.element_size()
        self._check_fits("combine", (outputs.shape[0] - mine) * row_bytes)
        comm = self.comm
        out = torch.zeros(plan.num_tokens, outputs.shape[1], dtype=outputs.dtype, device=outputs.device)
        back = self._rows("back", len(plan.tokens) - mine, outputs)   # the others' rows, weighted, plan order
        with comm.timer("moe_combine", (outputs.shape[0] - mine) * row_bytes) as timer:
            try:
                seq = comm.open_operation("moe_combine", timer)
                slot = comm.slot(r, seq)
                self._slot_rows(slot, 0, outputs.shape[0] - mine, outputs).copy_(outputs[mine:])
                comm.publish(seq)
                # summed in the plan's order (ascending expert id per token), as LocalDispatcher sums:
                # the rows for lower ranks' experts, this rank's own, then higher ranks'
                own_rows = weighted(outputs[:mine], plan.weights[own])
                if own.start == 0:
                    out.index_add_(0, plan.tokens[own], own_rows)
                comm.wait_published("moe_combine", seq, timer)
                at = start = 0   # at: row in back; start: row in the plan's order
                for d in range(ep):
                    n = sent[r][d]
                    if d != r and n:
                        before = sum(sent[s][d] for s in range(r) if s != d)   # rows d wrote ahead of ours
                        part = self._slot_rows(comm.slot(d, seq), 0, before + n, outputs)[before:]
                        _weighted_into(part, plan.weights[start:start + n], back[at:at + n])
                    at += n if d != r else 0
                    start += n
                comm.close_operation(seq)
            except CollectiveError as err:
                raise DispatchError("combine", err.reason) from None
        if own.start > 0:
            out.index_add_(0, plan.tokens[:own.start], back[:own.start])
            out.index_add_(0, plan.tokens[own], own_rows)
        if own.stop < len(plan.tokens):
            out.index_add_(0, plan.tokens[own.stop:], back[own.start:])
        return out


def _weighted_into(rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = ``rows`` ``[n, H]`` times ``weights`` ``[n]`` float32: the products ``weighted`` makes (fp32
    rounded to the rows' dtype), written to ``out`` without touching ``rows``."""
    if rows.dtype == torch.float32:
        torch.mul(rows, weights[:, None], out=out)
    else:
        out.copy_(rows.float() * weights[:, None])
