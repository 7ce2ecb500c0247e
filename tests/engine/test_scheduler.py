"""Scheduler invariants without a model: token budget, chunking, decode-first, admission, page accounting."""

import torch

from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceStatus

PS = 4


def make_scheduler(num_pages=32, chunk=8, budget=16, max_running=8):
    return Scheduler(PrefixCache(PageAllocator(num_pages), enabled=False), PS, chunk, budget, max_running)


def make_seq(rid, prompt_len, max_tokens=4):
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    prompt_len + max_tokens - 1, torch.Generator())


def advance(batch: list[ScheduledSeq]) -> None:
    """What the engine does after a forward: mark tokens computed, append one sampled token when due."""
    for item in batch:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.append_token(7, 0.0)


def test_chunked_prefill_respects_chunk_size_and_budget():
    s = make_scheduler(chunk=8, budget=12)
    a, b = make_seq("a", 20), make_seq("b", 20)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 8), ("b", 4)]
    advance(batch)
    batch = s.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 8), ("b", 4)]
    advance(batch)
    batch = s.schedule()  # a has 4 prompt tokens left, b 12
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 4), ("b", 8)]
    assert all(sum(i.num_new_tokens for i in b) <= 12 for b in [batch])


def test_decode_tokens_are_scheduled_before_prefill_chunks():
    s = make_scheduler(chunk=8, budget=8)
    a = make_seq("a", 3)
    s.add(a)
    advance(s.schedule())  # a prefilled, now decoding
    b = make_seq("b", 20)
    s.add(b)  # joins the running batch between steps
    batch = s.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 7)]


def test_budget_never_exceeded_over_a_whole_run():
    s = make_scheduler(num_pages=64, chunk=5, budget=7)
    seqs = [make_seq(str(i), n, max_tokens=3) for i, n in enumerate([1, 3, 4, 5, 9, 17])]
    for q in seqs:
        s.add(q)
    for _ in range(100):
        batch = s.schedule()
        if not batch:
            break
        assert sum(i.num_new_tokens for i in batch) <= 7
        assert all(i.num_new_tokens <= 5 for i in batch)
        assert len({id(i.seq) for i in batch}) == len(batch)
        advance(batch)
        for q in [q for q in s.running if q.num_output_tokens >= 3]:
            s.finish(q)
    assert not s.has_work() and s.allocator.num_free == 64


def test_admission_reserves_prompt_plus_max_tokens_pages():
    s = make_scheduler(num_pages=32)
    for n, max_tokens, pages in [(PS - 1, 1, 1), (PS, 1, 1), (PS + 1, 1, 2), (PS, 2, 2), (1, PS, 1)]:
        q = make_seq(f"{n}-{max_tokens}", n, max_tokens)
        free = s.allocator.num_free
        s.add(q)
        s.schedule()
        assert len(q.page_table) == pages and s.allocator.num_free == free - pages
        s.abort(q.request_id)
    assert s.allocator.num_free == 32


def test_waiting_head_blocks_until_pages_free_then_joins():
    s = make_scheduler(num_pages=4, chunk=64, budget=64)
    a, b = make_seq("a", 8, 5), make_seq("b", 8, 5)  # 12 KV tokens = 3 pages each
    s.add(a)
    s.add(b)
    assert [i.seq.request_id for i in s.schedule()] == ["a"]
    assert b.status == SequenceStatus.WAITING and b.page_table == []
    s.finish(a)
    assert [i.seq.request_id for i in s.schedule()] == ["b"]
    s.finish(b)
    assert s.allocator.num_free == 4


def test_max_running_requests_caps_admission():
    s = make_scheduler(max_running=2)
    for i in range(3):
        s.add(make_seq(str(i), 2))
    assert len(s.schedule()) == 2 and len(s.waiting) == 1


def test_abort_from_every_queue_frees_pages():
    s = make_scheduler(num_pages=16, chunk=4, budget=4)
    running, waiting, reserved = make_seq("r", 10), make_seq("w", 10), make_seq("v", 10)
    s.add(running)
    s.add(waiting)
    s.schedule()  # r takes the whole budget; w stays waiting
    assert s.reserve(reserved)
    held = make_seq("h", 2)
    s.add(held)
    assert s.allocator.num_free == 16 - 4 - 4
    for rid in ["r", "w", "v", "h", "unknown"]:
        s.abort(rid)
    assert s.allocator.num_free == 16 and not s.has_work() and not s.reserved


def test_hold_keeps_pages_until_release():
    s = make_scheduler(num_pages=8)
    q = make_seq("p", 5, max_tokens=1)
    s.add(q)
    advance(s.schedule())
    s.finish(q, hold=True)
    assert s.allocator.num_free == 8 - 2 and q.status == SequenceStatus.HELD
    assert s.release("p") and not s.release("p")
    assert s.allocator.num_free == 8


def test_reserve_refuses_without_taking_pages_when_short():
    s = make_scheduler(num_pages=2)
    assert not s.reserve(make_seq("big", 8, 4))
    assert s.allocator.num_free == 2 and not s.reserved
