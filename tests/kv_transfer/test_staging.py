"""The staged re-layout between instances whose KV heads are split over ranks differently
(``kv_transfer.staging``).

Invariants: packing every piece into a staging area smaller than the chunk and copying its spans leaves every
destination rank's pool exactly as the head-sliced copies do (each head's values, the unfilled slots of a
partial last page and every other page untouched); the plan's KV bytes equal the head-sliced bytes; a
destination region holding exactly a source region's heads moves its pages directly; a staging area smaller
than one destination page is refused; a room between managers so split lands byte for byte, whole pages (the
pieces posted as blocks) and a partly filled last page alike.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from kv_transfer import AuxData, KVArgs, KVPoll, make_kv_manager, unavailable_reason
from kv_transfer.head_slices import KVRegion, head_sliced_spans
from kv_transfer.layout import KVLayout
from kv_transfer.staging import StagingBuffer, pack, plan

SPLITS = {"tp1": [(0, 4)], "tp2": [(0, 2), (2, 4)], "uneven": [(0, 1), (1, 4)],
          "tp4": [(0, 1), (1, 2), (2, 3), (3, 4)], "replicated": [(0, 2), (0, 2), (2, 4), (2, 4)]}


def pools_of(layout: KVLayout, kv: np.ndarray | None, parts: list[tuple[int, int]]) -> list[np.ndarray]:
    """Per head range, a pool ``[num_pages, num_layers, 2, page_size, heads, head_dim]`` float32: ``kv``'s
    heads, or zeros."""
    shape = (layout.num_pages, layout.num_layers, 2, layout.page_size)
    return [np.ascontiguousarray(kv[..., a:b, :]) if kv is not None
            else np.zeros((*shape, b - a, layout.head_dim), dtype=np.float32) for a, b in parts]


def regions(pools: list[np.ndarray], parts: list[tuple[int, int]]) -> list[KVRegion]:
    return [KVRegion(a, b, pool.ctypes.data) for pool, (a, b) in zip(pools, parts)]


def copy(local: np.ndarray, remote: np.ndarray) -> None:
    assert np.array_equal(local[:, 1], remote[:, 1])
    for src, dst, nbytes in zip(local[:, 0].tolist(), remote[:, 0].tolist(), local[:, 1].tolist()):
        ctypes.memmove(dst, src, nbytes)


@pytest.mark.parametrize("head_dim", [3, 4])   # heads of 12 and 16 bytes
@pytest.mark.parametrize("src_split,dst_split", [("tp2", "tp1"), ("tp1", "tp2"), ("uneven", "tp4"),
                                                 ("uneven", "replicated")])
def test_staged_copies_equal_the_head_sliced_ones(head_dim: int, src_split: str, dst_split: str) -> None:
    layout = KVLayout(num_layers=2, num_pages=8, page_size=4, num_kv_heads=4, head_dim=head_dim)
    shape = (layout.num_pages, layout.num_layers, 2, layout.page_size, 4, head_dim)
    kv = np.random.default_rng(1).standard_normal(shape).astype(np.float32) + 1.0
    sparts, dparts = SPLITS[src_split], SPLITS[dst_split]
    src = regions(src_pools := pools_of(layout, kv, sparts), sparts)
    staged_pools, sliced_pools = pools_of(layout, None, dparts), pools_of(layout, None, dparts)
    src_pages, dst_pages = [4, 5, 1, 2, 7], [0, 1, 6, 3, 2]   # runs and single pages on both sides
    staging = StagingBuffer(1)   # one huge page, two halves
    # pieces of at most two pages: several per destination region, packed into alternate halves
    chunk = plan(layout, src, regions(staged_pools, dparts), src_pages, dst_pages, 3, 2 * layout.page_bytes)
    assert len(chunk.pieces) >= 2
    copy(chunk.direct_src, chunk.direct_dst)
    for k, piece in enumerate(chunk.pieces):
        copy(*pack(piece, layout, src, regions(staged_pools, dparts), staging, k % 2))
    local, remote = head_sliced_spans(layout, src, regions(sliced_pools, dparts), src_pages, dst_pages, 3)
    copy(local, remote)
    for staged, sliced in zip(staged_pools, sliced_pools):
        np.testing.assert_array_equal(staged, sliced)
    assert chunk.kv_bytes == local[:, 1].sum()
    assert src_pools   # the sources outlive the copies


def test_a_region_holding_a_source_regions_heads_moves_its_pages_directly() -> None:
    layout = KVLayout(num_layers=2, num_pages=8, page_size=4, num_kv_heads=4, head_dim=4)
    src = regions(pools_of(layout, None, SPLITS["uneven"]), SPLITS["uneven"])
    dst = regions(pools_of(layout, None, SPLITS["tp2"]), [(0, 1), (1, 4)])
    chunk = plan(layout, src, dst, [1, 2], [3, 4], None, layout.page_bytes)
    assert not chunk.pieces and len(chunk.direct_src) == 4   # one span per page and region


def test_a_staging_area_smaller_than_a_destination_page_is_refused() -> None:
    layout = KVLayout(num_layers=2, num_pages=8, page_size=4, num_kv_heads=4, head_dim=4)
    src = regions(pools_of(layout, None, SPLITS["tp2"]), SPLITS["tp2"])
    dst = regions(pools_of(layout, None, SPLITS["tp1"]), SPLITS["tp1"])
    with pytest.raises(ValueError, match="does not fit"):
        plan(layout, src, dst, [1], [2], None, layout.page_bytes - 1)
    assert replace(layout, num_kv_heads=2).page_bytes == layout.page_bytes // 2


def _wait(pred: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("backend", ["inprocess", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_a_staged_room_lands_byte_for_byte_through_a_manager(backend: str) -> None:
    """P TP=2 (heads 0 | 1-2) → D TP=1 through two managers: 40 whole pages (4 pieces of 10 pages in the
    halves of the 2 MiB staging area, each posted as 20 blocks of half a page) and then 37 pages whose last
    holds 5 tokens (the piece holding it posted as spans)."""
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    layout = KVLayout(num_layers=2, num_pages=96, page_size=16, num_kv_heads=3, head_dim=128)  # 96 KiB pages
    shape = (layout.num_pages, 2, 2, 16)
    kv = np.random.default_rng(2).standard_normal((*shape, 3, 128)).astype(np.float32)
    src_pools = [np.ascontiguousarray(kv[..., :1, :]), np.ascontiguousarray(kv[..., 1:, :])]
    dst_pool = np.zeros_like(kv)
    prefill = make_kv_manager(KVArgs(
        instance_id="prefill-tp2", role="prefill", kv_base_ptr=src_pools[0].ctypes.data,
        kv_nbytes=sum(p.nbytes for p in src_pools), layout=layout, model_id="m", staging_bytes=1,
        kv_regions=(KVRegion(0, 1, src_pools[0].ctypes.data), KVRegion(1, 3, src_pools[1].ctypes.data))),
        backend)
    decode = make_kv_manager(KVArgs(instance_id="decode-tp1", role="decode", kv_base_ptr=dst_pool.ctypes.data,
                                    kv_nbytes=dst_pool.nbytes, layout=layout, model_id="m"), backend)
    prefill.start()
    decode.start()
    try:
        for room, (src_pages, dst_pages, num_tokens) in enumerate(
                [(list(range(40)), list(range(50, 90)), 40 * 16),
                 (list(range(40, 77)), list(range(10, 47)), 36 * 16 + 5)], start=1):
            receiver = decode.create_receiver(room, "prefill-tp2", prefill.rendezvous_url)
            receiver.init(dst_pages)
            sender = prefill.create_sender(room)
            sender.init(len(src_pages), num_tokens)
            assert _wait(lambda s=sender: s.poll() >= KVPoll.WaitingForInput)
            sender.send(src_pages, True, AuxData(7, -0.5, room))
            assert _wait(lambda r=receiver: r.poll() in (KVPoll.Success, KVPoll.Failed))
            assert receiver.poll() == KVPoll.Success, receiver.failure
            full = num_tokens // 16
            np.testing.assert_array_equal(dst_pool[dst_pages[:full]], kv[src_pages[:full]])
            if num_tokens % 16:
                np.testing.assert_array_equal(dst_pool[dst_pages[-1], :, :, :5], kv[src_pages[-1], :, :, :5])
                assert not dst_pool[dst_pages[-1], :, :, 5:].any()
    finally:
        decode.shutdown()
        prefill.shutdown()
