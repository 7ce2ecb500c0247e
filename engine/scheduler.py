"""Continuous batching with chunked prefill under a per-step token budget; no preemption.

Each step: every decoding request in ``running`` gets one token first (oldest first); the remaining budget
goes to prefill chunks, first of admitted requests mid-prompt, then of ``waiting`` requests admitted in FIFO
order.
Admission takes all the pages a request may ever need at once (``Sequence.num_reserved_tokens``), so a running
request never runs short and nothing is preempted: its longest cached page-aligned prompt prefix is shared
from the ``PrefixCache`` (never the last prompt token, whose logits must be computed: vLLM's rule) and only
the rest is allocated, evicting unreferenced cached pages on demand. A waiting head that does not fit blocks
the queue (no overtaking, hence no starvation of long prompts). After each step, pages that became full of
computed KV are offered to the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.page_allocator import PageId
from engine.prefix_cache import PrefixCache, PrefixCacheStats, page_hashes, shareable_pages
from engine.sequence import RequestId, Sequence, SequenceStatus, pages_for_tokens


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: its next ``num_new_tokens`` uncomputed tokens."""

    seq: Sequence
    num_new_tokens: int


class Scheduler:
    """Owns the request queues and the page pool (``PrefixCache``: free list + cached pages).

    Queues: ``waiting`` (no pages), ``running`` (pages held, being computed), ``reserved`` (decode mode, pages
    held, KV arriving), ``held`` (prefill mode, pages held, KV being sent).
    """

    def __init__(self, pages: PrefixCache, page_size: int, chunk_size: int,
                 max_num_batched_tokens: int, max_running_requests: int) -> None:
        self.pages = pages
        self.allocator = pages.allocator
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_running_requests = max_running_requests
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[RequestId, Sequence] = {}
        self.held: dict[RequestId, Sequence] = {}

    def pages_needed(self, seq: Sequence) -> int:
        return pages_for_tokens(seq.num_reserved_tokens, self.page_size)

    @property
    def num_allocatable_pages(self) -> int:
        """Pages a new request can take now (free, plus cached pages no request holds)."""
        return self.pages.num_allocatable

    @property
    def num_pages(self) -> int:
        """Pages of the pool."""
        return self.allocator.num_pages

    def cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters."""
        return self.pages.stats()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request (status ``WAITING``)."""
        self.waiting.append(seq)

    def reserve(self, seq: Sequence) -> bool:
        """Take the request's pages now and park it in ``reserved``; False (nothing taken) if short.

        Shares the prompt's longest cached prefix as admission does (never the last prompt token's page):
        a peer writes the prompt's KV only into the pages after it (``seq.num_cached_tokens`` says where).
        """
        if not self._take_pages(seq, self._match(seq)):
            return False
        seq.set_status(SequenceStatus.RESERVED)
        self.reserved[seq.request_id] = seq
        return True

    def start_reserved(self, request_id: RequestId) -> Sequence:
        """Move a reserved request to ``running``. Raises KeyError if it is not reserved."""
        seq = self.reserved.pop(request_id)
        seq.set_status(SequenceStatus.RUNNING)
        self.running.append(seq)
        return seq

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work: decode tokens, then prefill chunks, within ``max_num_batched_tokens``."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in self.running:
            if budget > 0 and not seq.is_prefilling and seq.num_uncomputed_tokens > 0:
                batch.append(ScheduledSeq(seq, 1))
                budget -= 1
        for seq in self.running:
            if budget > 0 and seq.is_prefilling:
                budget -= self._add_chunk(batch, seq, budget)
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            budget -= self._add_chunk(batch, self.waiting.popleft(), budget)
        return batch

    def _admit(self, seq: Sequence) -> bool:
        if len(self.running) >= self.max_running_requests:
            return False
        if not self._take_pages(seq, self._match(seq)):
            return False
        seq.set_status(SequenceStatus.RUNNING)
        self.running.append(seq)
        return True

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq`` this pool's prefix cache holds now (what admission would share); takes
        nothing."""
        return len(self._match(seq)) * self.page_size

    def _match(self, seq: Sequence) -> list[PageId]:
        """Cached pages of the prompt's longest prefix, leaving at least the last prompt token to compute."""
        if not self.pages.enabled:
            return []
        keys = page_hashes(seq.token_ids[:seq.num_prompt_tokens], self.page_size, seq.page_hashes)
        return self.pages.match(keys[:shareable_pages(seq.num_prompt_tokens, self.page_size)])

    def _take_pages(self, seq: Sequence, shared: list[PageId]) -> bool:
        num_new = self.pages_needed(seq) - len(shared)
        if not self.pages.can_allocate(num_new, shared):
            return False
        self.pages.acquire(shared)
        seq.page_table = shared + self.pages.allocate(num_new)
        seq.num_cached_tokens = seq.num_computed_tokens = len(shared) * self.page_size
        seq.num_registered_pages = len(shared)
        self.pages.count_query(seq.num_prompt_tokens, seq.num_cached_tokens)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Offer the prefix cache every page of ``seq`` that became full of computed KV (after a step)."""
        num_full = seq.num_computed_tokens // self.page_size
        if not self.pages.enabled or num_full <= seq.num_registered_pages:
            return
        keys = page_hashes(seq.token_ids[:num_full * self.page_size], self.page_size, seq.page_hashes)
        for i in range(seq.num_registered_pages, num_full):
            self.pages.register(seq.page_table[i], keys[i])
        seq.num_registered_pages = num_full

    def _add_chunk(self, batch: list[ScheduledSeq], seq: Sequence, budget: int) -> int:
        n = min(self.chunk_size, budget, seq.num_prefill_tokens - seq.num_computed_tokens)
        batch.append(ScheduledSeq(seq, n))
        return n

    def finish(self, seq: Sequence, hold: bool = False) -> None:
        """Take a running request out of ``running``; release its pages (keyed ones stay cached), or keep them
        in ``held``."""
        self.running.remove(seq)
        if hold:
            seq.set_status(SequenceStatus.HELD)
            self.held[seq.request_id] = seq
        else:
            self._free(seq)

    def release(self, request_id: RequestId) -> bool:
        """Free a held request's pages; False if it is not held."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self._free(seq)
        return True

    def abort(self, request_id: RequestId) -> Sequence | None:
        """Remove the request from whichever queue holds it and free its pages; None if unknown."""
        seq = self.held.pop(request_id, None) or self.reserved.pop(request_id, None)
        if seq is None:
            seq = self._pop_queued(request_id)
        if seq is not None:
            self._free(seq)
        return seq

    def _pop_queued(self, request_id: RequestId) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return seq
        return None

    def _free(self, seq: Sequence) -> None:
        self.pages.release(seq.page_table)
        seq.page_table = []
        seq.set_status(SequenceStatus.FINISHED)
