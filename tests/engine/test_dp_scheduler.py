"""``DataParallelScheduler`` (engine/dp_scheduler.py): one scheduler per DP-attention rank, pure bookkeeping.

Invariants: each rank hands out its own page ids; a new request goes to the rank with the least work left
among those whose free pages hold it now, even when a fuller rank has less work, unless the caller names its
rank (then that rank, and a reservation waits for it); every item of a step names its rank, rank 0's first;
finishing or aborting a request frees its pages in its own rank only; the instance's page counts are the
ranks' sums.
"""

from __future__ import annotations

import torch

from engine.dp_scheduler import DataParallelScheduler
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

PAGE = 4


def ranks(pages: int = 4) -> DataParallelScheduler:
    return DataParallelScheduler([Scheduler(PrefixCache(PageAllocator(pages), enabled=False), PAGE, 64, 64, 8)
                                  for _ in range(2)])


def seq(rid: str, prompt_tokens: int, reserved_tokens: int) -> Sequence:
    return Sequence(rid, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=1), reserved_tokens,
                    torch.Generator())


def test_a_request_goes_to_the_least_loaded_rank_that_has_room_for_it() -> None:
    dp = ranks()
    whole, busy = seq("whole", 15, 16), seq("busy", 4, 8)   # all 4 pages of a rank; 2 pages
    dp.add(whole)
    dp.add(busy)
    assert [(s.seq.request_id, s.seq.dp_rank) for s in dp.schedule()] == [("whole", 0), ("busy", 1)]
    whole.num_computed_tokens = 14          # 2 tokens left on rank 0 (no page free), 8 on rank 1 (2 free)
    small = seq("small", 4, 4)
    dp.add(small)
    assert small.dp_rank == 1               # less work left on rank 0, but no room there
    step = dp.schedule()
    assert [(s.seq.request_id, s.seq.dp_rank) for s in step] == [("whole", 0), ("busy", 1), ("small", 1)]
    assert whole.page_table == [0, 1, 2, 3] and busy.page_table == [0, 1] and small.page_table == [2]
    assert dp.num_pages == 8 and dp.num_allocatable_pages == 1
    assert [load.requests for load in dp.loads] == [1, 2]


def test_finish_and_abort_free_pages_in_the_requests_own_rank() -> None:
    dp = ranks()
    a, b = seq("a", 3, 8), seq("b", 3, 8)
    dp.add(a)
    dp.add(b)
    dp.schedule()
    assert (a.dp_rank, b.dp_rank) == (0, 1) and dp.num_allocatable_pages == 4
    dp.finish(b)
    assert [r.num_allocatable_pages for r in dp.ranks] == [2, 4] and dp.rank_of("b") is None
    assert dp.abort("a") is a and dp.abort("a") is None
    assert [r.num_allocatable_pages for r in dp.ranks] == [4, 4] and not dp.has_work()


def test_a_named_rank_is_used_even_where_assign_would_pick_another_and_reserve_waits_for_it() -> None:
    """A router's rank (``add``/``reserve`` with ``rank``) is kept as given: the request queues on it even
    when the other rank has less work, and a reservation that the named rank cannot hold now takes nothing
    (no fallback to the other rank) until that rank has room."""
    dp = ranks()
    dp.add(seq("busy", 8, 8), rank=1)            # rank 1 busy, rank 0 idle: assign would pick rank 0
    more = seq("more", 4, 4)
    dp.add(more, rank=1)
    assert (more.dp_rank, dp.rank_of("more")) == (1, 1) and [load.requests for load in dp.loads] == [0, 2]
    dp.schedule()                                # rank 1: 3 of its 4 pages taken (2 + 1)
    big = seq("big", 8, 8)                       # 2 pages: rank 0 could hold it, rank 1 cannot now
    assert not dp.reserve(big, rank=1) and dp.rank_of("big") is None
    assert [r.num_allocatable_pages for r in dp.ranks] == [4, 1]
    assert dp.reserve(big, rank=0) and big.page_table == [0, 1] and big.dp_rank == 0
