"""A WRITE split between the UCX backend's copy threads keeps the transport contract: every byte has landed
when the peer sees the notification, and the write is done when ``post_write`` returns; a process pinned to
one core, or one whose KV may cross the network, gets no copy threads."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import numpy as np
import pytest
from kv_harness import host_side

from kv_transfer.aux import AUX_SLOT_BYTES

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]

NUM_PAGES = 40   # a write of 32 pages + the aux slot: above SPLIT_MIN_DESCS


def test_split_write_lands_every_byte_before_its_notification() -> None:
    from kv_transfer.nixl_transport import SPLIT_MIN_DESCS, NixlTransport

    src_pool, _src_aux, src_table = host_side(NUM_PAGES, 7.0)   # _src_aux: registered memory, kept alive
    dst_pool, dst_aux, dst_table = host_side(NUM_PAGES, 1.0)
    src_pool[:] = np.arange(len(src_pool), dtype=np.float32)
    sender, target = NixlTransport("split-src", copy_threads=2), NixlTransport("split-dst", copy_threads=0)
    try:
        sender.register(src_table)
        target.register(dst_table)
        peer = sender.add_peer(target.metadata(), dst_table)
        src_pages, dst_pages = list(range(2, 34)), list(range(5, 37))   # contiguous: one run, unmerged
        local = src_table.kv_indices(src_pages, aux_slot=0)
        remote = dst_table.kv_indices(dst_pages, aux_slot=1)
        assert len(local) >= SPLIT_MIN_DESCS
        got: list[bytes] = []
        stop = threading.Event()

        def target_loop() -> None:   # the decode manager's ticks: UCX progress on the target
            deadline = time.monotonic() + 10.0
            while not stop.is_set() and b"done" not in got and time.monotonic() < deadline:
                got.extend(m for _, m in target.get_notifs())
                time.sleep(0.0005)

        thread = threading.Thread(target=target_loop, daemon=True)
        thread.start()
        t0 = time.monotonic()
        handle = sender.post_write(peer, local, remote, b"done")
        post_s = time.monotonic() - t0
        state = sender.check(handle).name
        thread.join(10.0)
        stop.set()
        sender.release(handle)
        assert state == "DONE", f"post_write returned after {post_s:.3f}s with {state}"
        assert b"done" in got
        page_floats = src_table.kv_desc_bytes // 4
        src_view = src_pool.reshape(NUM_PAGES, page_floats)
        dst_view = dst_pool.reshape(NUM_PAGES, page_floats)
        assert np.array_equal(dst_view[dst_pages], src_view[src_pages])
        untouched = [p for p in range(NUM_PAGES) if p not in dst_pages]
        assert (dst_view[untouched] == 1.0).all()
        assert (dst_aux[AUX_SLOT_BYTES:] == 7).all() and (dst_aux[:AUX_SLOT_BYTES] == 1).all()
    finally:
        sender.close()
        target.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_no_copy_threads_when_pinned_to_one_core() -> None:
    from kv_transfer.nixl_transport import COPY_THREADS, copy_threads_for

    cores = os.sched_getaffinity(0)
    assert copy_threads_for("VRAM") == 0
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert copy_threads_for("DRAM") == 0
    finally:
        os.sched_setaffinity(0, cores)
    assert copy_threads_for("DRAM") == (COPY_THREADS if len(cores) >= COPY_THREADS else 0)


def test_no_copy_threads_where_kv_may_cross_the_network() -> None:
    from kv_transfer.nixl_transport import copy_threads_for, kv_may_cross_network

    # over TCP a split WRITE was two connections' socket writes on the same cores: docs/multihost.md
    assert copy_threads_for("DRAM", over_network=True) == 0
    assert kv_may_cross_network("127.0.0.1", network_only=True)
    assert kv_may_cross_network("10.0.0.7", network_only=False)
    assert not kv_may_cross_network("127.0.0.1", network_only=False)
