"""``DataParallelScheduler``: one ``Scheduler`` per DP-attention rank behind the single scheduler's interface.

A DP-attention engine (``EngineConfig.enable_dp_attention``, docs/parallelism.md) runs attention for each
request on one rank, over that rank's own KV pool. Rank 0 (the engine's process) keeps every rank's queues
and page bookkeeping here: one ``Scheduler`` (its own ``PrefixCache`` and page ids) per rank. Lifecycle of a
request:

1. ``add`` (or ``reserve``) assigns it to a rank for good and queues it there; ``Sequence.dp_rank`` says
   where. The rank is the caller's when it names one (a PD router chooses the rank of each request it
   pairs), else ``assign``'s: first a rank whose free pages hold it now, then the least
   work once it is there (the tokens the rank still has to compute, less the request's prompt tokens that
   rank's prefix cache holds), then the fewest requests, then the lowest rank.
2. ``schedule`` runs every rank's own scheduler (each with the whole per-step budgets: every rank computes
   its own batch) and returns their work rank by rank: rank 0's items first, each rank's in its own order.
3. ``register_computed``, ``finish``, ``abort``, ``release`` go to the request's rank.

Pure bookkeeping, no tensors; called only from the engine's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.prefix_cache import PrefixCacheStats
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import RequestId, Sequence


@dataclass
class DPRankLoad:
    """Counters of one DP rank since the engine started (``LLMEngine.dp_loads``).

    Attributes:
        requests: requests assigned to the rank.
        tokens: tokens the rank computed (prefill and decode, as scheduled).
        busy_steps: steps in which the rank had work (the others ran an idle batch or their own).
    """

    requests: int = 0
    tokens: int = 0
    busy_steps: int = 0


class DataParallelScheduler:
    """Every DP rank's ``Scheduler``, with the interface of one (module docstring).

    Args:
        ranks: one scheduler per rank, rank 0 first; the same page size on all.
    Attributes:
        ranks: as given.
        loads: one ``DPRankLoad`` per rank.
    """

    def __init__(self, ranks: list[Scheduler]) -> None:
        if not ranks:
            raise ValueError("a DP scheduler needs at least one rank")
        self.ranks = ranks
        self.page_size = ranks[0].page_size
        self.loads = [DPRankLoad() for _ in ranks]
        self._rank_of: dict[RequestId, int] = {}

    # ---- the one-scheduler interface -----------------------------------------------------------------------
    def pages_needed(self, seq: Sequence) -> int:
        return self.ranks[0].pages_needed(seq)

    @property
    def num_allocatable_pages(self) -> int:
        """Pages every rank can give new requests now, summed (one request takes pages of one rank only)."""
        return sum(r.num_allocatable_pages for r in self.ranks)

    @property
    def num_pages(self) -> int:
        """Pages of every rank's pool, summed."""
        return sum(r.num_pages for r in self.ranks)

    def cache_stats(self) -> PrefixCacheStats:
        """Every rank's prefix-cache counters, summed."""
        stats = [r.cache_stats() for r in self.ranks]
        return PrefixCacheStats(sum(s.queries_tokens for s in stats), sum(s.hits_tokens for s in stats),
                                sum(s.cached_pages for s in stats), sum(s.evictable_pages for s in stats))

    @property
    def reserved(self) -> dict[RequestId, Sequence]:
        """Every rank's reserved requests (a new dict)."""
        return {rid: seq for r in self.ranks for rid, seq in r.reserved.items()}

    def has_work(self) -> bool:
        return any(r.has_work() for r in self.ranks)

    def add(self, seq: Sequence, rank: int | None = None) -> None:
        """Queue ``seq`` on ``rank`` (None: the rank ``assign`` picks). The caller checked ``rank`` is one of
        ``ranks``."""
        self.ranks[self._place(seq, rank)].add(seq)

    def reserve(self, seq: Sequence, rank: int | None = None) -> bool:
        """Take ``seq``'s pages on ``rank`` (None: the rank ``assign`` picks) now; False (nothing taken, no
        rank kept) when that rank is short."""
        rank = self._place(seq, rank)
        if self.ranks[rank].reserve(seq):
            return True
        self._forget(seq.request_id)
        return False

    def start_reserved(self, request_id: RequestId) -> Sequence:
        """Raises KeyError when ``request_id`` is not reserved."""
        return self.ranks[self._rank_of[request_id]].start_reserved(request_id)

    def schedule(self) -> list[ScheduledSeq]:
        """Every rank's work of this step, rank by rank (``Sequence.dp_rank`` on each item's sequence)."""
        work: list[ScheduledSeq] = []
        for rank, scheduler in enumerate(self.ranks):
            mine = scheduler.schedule()
            if mine:
                self.loads[rank].busy_steps += 1
                self.loads[rank].tokens += sum(item.num_new_tokens for item in mine)
            work.extend(mine)
        return work

    def register_computed(self, seq: Sequence) -> None:
        self.ranks[seq.dp_rank].register_computed(seq)

    def finish(self, seq: Sequence, hold: bool = False) -> None:
        self.ranks[seq.dp_rank].finish(seq, hold)
        if not hold:
            self._forget(seq.request_id)

    def release(self, request_id: RequestId) -> bool:
        rank = self._rank_of.get(request_id)
        if rank is None or not self.ranks[rank].release(request_id):
            return False
        self._forget(request_id)
        return True

    def abort(self, request_id: RequestId) -> Sequence | None:
        rank = self._rank_of.get(request_id)
        if rank is None:
            return None
        self._forget(request_id)
        return self.ranks[rank].abort(request_id)

    # ---- placement -----------------------------------------------------------------------------------------
    def rank_of(self, request_id: RequestId) -> int | None:
        """The rank a live request was assigned to; None for an unknown or finished one."""
        return self._rank_of.get(request_id)

    def assign(self, seq: Sequence) -> int:
        """The rank a new request goes to: among the ranks whose allocatable pages hold all it needs now (all
        ranks if none does), the one with the least work once the request is there: the tokens it still has
        to compute (its queued prompts, the rest of its running requests' reserved tokens) less the request's
        prompt tokens its prefix cache holds (those are not computed again); then the fewest live requests,
        then the lowest rank."""
        need = self.pages_needed(seq)
        fits = [r for r, s in enumerate(self.ranks) if s.num_allocatable_pages >= need] or \
            list(range(len(self.ranks)))

        def work(r: int) -> tuple[int, int, int]:
            rank = self.ranks[r]
            return _pending_tokens(rank) - rank.cached_prefix_tokens(seq), _live(rank), r

        return min(fits, key=work)

    def _place(self, seq: Sequence, rank: int | None) -> int:
        rank = seq.dp_rank = self.assign(seq) if rank is None else rank
        self._rank_of[seq.request_id] = rank
        self.loads[rank].requests += 1
        return rank

    def _forget(self, request_id: RequestId) -> None:
        self._rank_of.pop(request_id, None)


def _pending_tokens(scheduler: Scheduler) -> int:
    """Tokens a rank's live requests may still compute (reserved minus computed)."""
    seqs = [*scheduler.waiting, *scheduler.running, *scheduler.reserved.values()]
    return sum(max(0, s.num_reserved_tokens - s.num_computed_tokens) for s in seqs)


def _live(scheduler: Scheduler) -> int:
    return len(scheduler.waiting) + len(scheduler.running) + len(scheduler.reserved) + len(scheduler.held)
