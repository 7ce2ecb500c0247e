"""Child of test_nixl_progress_thread.py (its own process: UCX reads ``UCX_TLS`` once per process). Two NIXL
transports over TCP only (``network_only``); the target's caller never calls into NIXL while the sender's
WRITE is in flight. Prints one JSON object: the write's state and seconds, whether the bytes landed, and the
copy threads each side chose for itself (``copy_threads_for``: none where KV may cross the network).

Usage: python nixl_progress_child.py PROGRESS_THREAD_MS WAIT_S"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_harness import host_side  # noqa: E402

from kv_transfer.nixl_transport import NixlTransport  # noqa: E402

NUM_PAGES = 40


def main() -> None:
    progress_thread_ms, wait_s = float(sys.argv[1]), float(sys.argv[2])
    src_pool, _src_aux, src_table = host_side(NUM_PAGES, 7.0)   # _src_aux: registered memory, kept alive
    dst_pool, _dst_aux, dst_table = host_side(NUM_PAGES, 1.0)
    src_pool[:] = np.arange(len(src_pool), dtype=np.float32)
    sender = NixlTransport("progress-src", network_only=True)   # copy threads: the transport's own rule
    target = NixlTransport("progress-dst", network_only=True, progress_thread_ms=progress_thread_ms)
    sender.register(src_table)
    target.register(dst_table)
    peer = sender.add_peer(target.metadata(), dst_table)
    # the first contact (add_peer's warm-up message) is met by the target's first progress, as in serving
    deadline = time.monotonic() + 5.0
    while not target.get_notifs() and time.monotonic() < deadline:
        time.sleep(0.001)
    src_pages, dst_pages = list(range(2, 34)), list(range(5, 37))   # 32 pages: ~1.4 MiB
    t0 = time.monotonic()
    handle = sender.post_write(peer, src_table.kv_indices(src_pages, aux_slot=0),
                               dst_table.kv_indices(dst_pages, aux_slot=1), b"done")
    state = sender.check(handle).name
    while state == "PROC" and time.monotonic() - t0 < wait_s:   # only the sender's side is progressed
        time.sleep(0.0005)
        state = sender.check(handle).name
    done_s = time.monotonic() - t0
    page_floats = src_table.kv_desc_bytes // 4
    landed = bool(np.array_equal(dst_pool.reshape(NUM_PAGES, page_floats)[dst_pages],
                                 src_pool.reshape(NUM_PAGES, page_floats)[src_pages]))
    if state == "DONE":
        sender.release(handle)
    print(json.dumps({"state": state, "seconds": round(done_s, 4), "landed": landed,
                      "copy_threads": [sender._copy_threads, target._copy_threads]}), flush=True)
    # the target progresses now: an unfinished write ends, so both agents close cleanly
    deadline = time.monotonic() + 10.0
    while state == "PROC" and time.monotonic() < deadline:
        target.get_notifs()
        state = sender.check(handle).name
    sender.close()
    target.close()


if __name__ == "__main__":
    main()
