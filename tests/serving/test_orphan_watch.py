"""``serving.orphan_watch``: ``stop`` ends and joins the watch thread at once (``finalize`` leaves no thread that
runs Python while the stub tears down)."""

from __future__ import annotations

import threading
import time

from serving.orphan_watch import OrphanWatch


def test_stop_joins_the_thread_without_waiting_out_the_interval() -> None:
    watch = OrphanWatch("t0", interval_s=30.0).start()
    assert any(t.name == "orphan-watch-t0" for t in threading.enumerate())
    start_s = time.monotonic()
    watch.stop(timeout_s=5.0)
    assert time.monotonic() - start_s < 2.0
    assert not any(t.name == "orphan-watch-t0" for t in threading.enumerate())
    watch.stop()   # idempotent
