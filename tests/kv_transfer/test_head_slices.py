"""Head-sliced copies between instances whose KV heads are split over ranks differently
(``kv_transfer.head_slices``).

Invariants: after the copies, every destination rank's pool holds, for every page pair, layer, plane, token
and KV head it holds, exactly the source's values of that head (any split on either side, uneven and
replicated ones included); bytes outside the copied pages, and the unfilled slots of a partial last page, stay
untouched; the bytes moved equal the KV's own size times the destination's replicas, never more; a head no
source holds, or a region list leaving a head out, is refused.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kv_transfer.head_slices import KVRegion, coverage_problem, head_sliced_spans
from kv_transfer.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_pages=6, page_size=4, num_kv_heads=4, head_dim=3)


def split(num_heads: int, parts: list[tuple[int, int]]) -> list[np.ndarray]:
    """One float32 pool ``[num_pages, heads, num_layers, 2, page_size, head_dim]`` per head range, zeroed."""
    return [np.zeros((LAYOUT.num_pages, b - a, LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.head_dim),
                     dtype=np.float32) for a, b in parts]


def regions(pools: list[np.ndarray], parts: list[tuple[int, int]]) -> list[KVRegion]:
    return [KVRegion(a, b, pool.ctypes.data) for pool, (a, b) in zip(pools, parts)]


def whole_kv(seed: int) -> np.ndarray:
    """The model's KV of every head: ``[num_pages, num_kv_heads, num_layers, 2, page_size, head_dim]``."""
    shape = (LAYOUT.num_pages, LAYOUT.num_kv_heads, LAYOUT.num_layers, 2, LAYOUT.page_size, LAYOUT.head_dim)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) + 1.0


SPLITS = {"tp1": [(0, 4)], "tp2": [(0, 2), (2, 4)], "uneven": [(0, 1), (1, 4)],
          "tp4": [(0, 1), (1, 2), (2, 3), (3, 4)], "replicated": [(0, 2), (0, 2), (2, 4), (2, 4)]}


@pytest.mark.parametrize("src_split,dst_split", [("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp4"),
                                                 ("tp4", "tp2"), ("uneven", "tp2"), ("tp2", "tp2"),
                                                 ("tp1", "replicated")])
@pytest.mark.parametrize("last_page_tokens", [None, 3])
def test_every_destination_rank_gets_exactly_its_heads(src_split: str, dst_split: str,
                                                       last_page_tokens: int | None) -> None:
    kv = whole_kv(1)
    sparts, dparts = SPLITS[src_split], SPLITS[dst_split]
    src_pools = [np.ascontiguousarray(kv[:, a:b]) for a, b in sparts]
    dst_pools = split(LAYOUT.num_kv_heads, dparts)
    src_pages, dst_pages = [4, 1, 2], [0, 5, 3]
    local, remote = head_sliced_spans(LAYOUT, regions(src_pools, sparts), regions(dst_pools, dparts),
                                      src_pages, dst_pages, last_page_tokens)
    assert np.array_equal(local[:, 1], remote[:, 1])
    for (src, dst, nbytes) in zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()):
        ctypes.memmove(dst, src, nbytes)
    filled = [LAYOUT.page_size] * 2 + [last_page_tokens or LAYOUT.page_size]
    for pool, (a, b) in zip(dst_pools, dparts):
        for sp, dp, n in zip(src_pages, dst_pages, filled):
            np.testing.assert_array_equal(pool[dp, ..., :n, :], kv[sp, a:b, ..., :n, :])
            assert not pool[dp, ..., n:, :].any()
        untouched = [p for p in range(LAYOUT.num_pages) if p not in dst_pages]
        assert not pool[untouched].any()
    token_bytes = LAYOUT.num_layers * 2 * LAYOUT.head_dim * 4
    replicas = sum(b - a for a, b in dparts) // LAYOUT.num_kv_heads
    assert local[:, 1].sum() == sum(filled) * token_bytes * LAYOUT.num_kv_heads * replicas


def test_whole_pages_move_as_one_span_per_page_and_source_head_range() -> None:
    """Head-major pages: P TP=2 (uneven 1 + 3 heads) -> D TP=1 is two spans per page, each a source rank's
    whole head range (120-240 KiB for SmolLM2's pages), not one per token; a partly filled last page adds one
    span per (head, layer, plane)."""
    uneven, tp1 = SPLITS["uneven"], SPLITS["tp1"]
    src, dst = regions(split(4, uneven), uneven), regions(split(4, tp1), tp1)
    local, remote = head_sliced_spans(LAYOUT, src, dst, [4, 1, 2], [0, 5, 3])
    assert len(local) == 3 * 2
    assert sorted(set(local[:, 1].tolist())) == [LAYOUT.page_head_bytes, 3 * LAYOUT.page_head_bytes]
    local, _ = head_sliced_spans(LAYOUT, src, dst, [4, 1, 2], [0, 5, 3], last_page_tokens=3)
    assert len(local) == 2 * 2 + 4 * LAYOUT.num_layers * 2


def test_same_split_moves_whole_pages_as_one_span_per_page_run() -> None:
    tp2 = SPLITS["tp2"]
    src, dst = regions(split(4, tp2), tp2), regions(split(4, tp2), tp2)
    local, _ = head_sliced_spans(LAYOUT, src, dst, [1, 2], [3, 4])
    assert len(local) == 2   # per rank pair: pages 1-2 → 3-4 is one contiguous run on both sides


def test_a_head_no_source_holds_and_an_uncovered_split_are_refused() -> None:
    pools = split(4, [(0, 2)])
    with pytest.raises(ValueError, match="KV head 2"):
        head_sliced_spans(LAYOUT, regions(pools, [(0, 2)]), regions(split(4, [(0, 4)]), [(0, 4)]), [0], [0])
    assert "[2, 3]" in str(coverage_problem(regions(pools, [(0, 2)]), 4))
    assert coverage_problem(regions(split(4, SPLITS["tp2"]), SPLITS["tp2"]), 4) is None


def test_the_handshake_refuses_a_peer_whose_ranks_leave_a_head_out_by_name() -> None:
    from kv_transfer.errors import CompatibilityError
    from kv_transfer.peers import kv_info, peer_regions

    ok = kv_info("m", LAYOUT, 4096, 8192, 2, (KVRegion(0, 2, 4096), KVRegion(2, 4, 1 << 20)))
    assert peer_regions(ok, LAYOUT, LAYOUT) == (KVRegion(0, 2, 4096), KVRegion(2, 4, 1 << 20))
    assert peer_regions(kv_info("m", LAYOUT, 4096, 8192, 2), LAYOUT, LAYOUT) == ()
    for bad in ([[0, 2, 4096], [3, 4, 1 << 20]], [[0, 5, 4096]], [[0, 2]]):
        with pytest.raises(CompatibilityError) as info:
            peer_regions({**ok, "kv_regions": bad}, LAYOUT, LAYOUT)
        assert info.value.field == "kv_regions"


def test_a_split_instance_registers_a_hash_only_a_peer_that_reads_its_regions_accepts() -> None:
    from kv_transfer.errors import CompatibilityError
    from kv_transfer.layout import check_compatible, compat_hash

    split_hash = compat_hash("m", LAYOUT, sliced=True)
    assert split_hash != compat_hash("m", LAYOUT)
    check_compatible("m", LAYOUT, "m", LAYOUT, split_hash, their_sliced=True)
    with pytest.raises(CompatibilityError) as info:   # what a build reading no kv_regions checks
        check_compatible("m", LAYOUT, "m", LAYOUT, split_hash)
    assert info.value.field == "compat_hash"
