"""``EngineLoop``: one thread owns the engine; every request gets exactly one terminal event; a failure
reaches its own request only; an idle loop sleeps."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving_fakes import FakeEngine

from engine.errors import RequestRejected
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from serving.events import LoopEvent, LoopStopped, RequestAborted, RequestFailed
from serving.workers.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(30)


class Collector:
    def __init__(self) -> None:
        self.events: list[LoopEvent] = []
        self.done = threading.Event()

    def __call__(self, event: LoopEvent) -> None:
        self.events.append(event)
        if isinstance(event, RequestFailed) or event.finished:
            self.done.set()

    def wait(self) -> LoopEvent:
        assert self.done.wait(10), "no terminal event"
        return self.events[-1]

    @property
    def terminals(self) -> int:
        return sum(isinstance(e, RequestFailed) or e.finished for e in self.events)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def loop(engine: FakeEngine):
    lp = EngineLoop(engine, name="test-loop", idle_wait_s=0.05)
    yield lp
    assert lp.stop(5)


def test_constructor_starts_nothing(engine: FakeEngine) -> None:
    lp = EngineLoop(engine, name="idle")
    assert not lp.running
    assert all(t.name != "idle" for t in threading.enumerate())
    with pytest.raises(LoopStopped):
        lp.submit("r", [1], SamplingParams(), lambda e: None)


def test_requests_batch_and_finish_once_each(loop: EngineLoop, engine: FakeEngine) -> None:
    loop.start()
    cols = {f"r{i}": Collector() for i in range(4)}
    for i, (rid, col) in enumerate(cols.items()):
        loop.submit(rid, [1] * (i + 1), SamplingParams(max_tokens=3 + i), col)
    for col in cols.values():
        last = col.wait()
        assert isinstance(last, RequestOutput) and last.finish_reason == "length"
        assert col.terminals == 1
        assert "".join(e.new_text for e in col.events if isinstance(e, RequestOutput)) == \
            "".join(f"w{k} " for k in range(1, last.num_output_tokens + 1))
    assert engine.num_free_pages == engine.num_total_pages
    assert engine.thread_ids == {loop._thread.ident}  # type: ignore[union-attr]


def test_rejection_fails_only_that_request(loop: EngineLoop) -> None:
    loop.start()
    bad, good = Collector(), Collector()
    loop.submit("good", [1], SamplingParams(max_tokens=5), good)
    loop.submit("bad", [1] * 500, SamplingParams(max_tokens=5), bad)
    failed = bad.wait()
    assert isinstance(failed, RequestFailed) and isinstance(failed.error, RequestRejected)
    assert isinstance(good.wait(), RequestOutput) and good.terminals == 1


def test_abort_frees_pages_and_ends_with_one_terminal(loop: EngineLoop, engine: FakeEngine) -> None:
    loop.start()
    col = Collector()
    loop.submit("long", [1, 2], SamplingParams(max_tokens=10_000 // 200), col)
    loop.abort("long", "test")
    last = col.wait()
    assert isinstance(last, RequestFailed) and isinstance(last.error, RequestAborted)
    time.sleep(0.1)
    assert col.terminals == 1 and engine.num_free_pages == engine.num_total_pages


def test_callback_error_aborts_that_request_only(loop: EngineLoop, engine: FakeEngine) -> None:
    loop.start()
    good = Collector()
    calls: list[LoopEvent] = []

    def bad(event: LoopEvent) -> None:
        calls.append(event)
        raise ValueError("client gone")

    loop.submit("bad", [1], SamplingParams(max_tokens=20), bad)
    loop.submit("good", [1], SamplingParams(max_tokens=5), good)
    assert isinstance(good.wait(), RequestOutput)
    time.sleep(0.1)
    assert isinstance(calls[-1], RequestFailed) and len(calls) == 2
    assert engine.num_free_pages == engine.num_total_pages


def test_step_error_fails_the_batch_and_the_loop_goes_on(loop: EngineLoop, engine: FakeEngine) -> None:
    loop.start()
    first = Collector()
    engine.fail_next_step = True
    loop.submit("a", [1], SamplingParams(max_tokens=3), first)
    assert isinstance(first.wait(), RequestFailed)
    after = Collector()
    loop.submit("b", [1], SamplingParams(max_tokens=3), after)
    assert isinstance(after.wait(), RequestOutput)


def test_stop_fails_requests_in_flight(engine: FakeEngine) -> None:
    lp = EngineLoop(engine, name="stopper", idle_wait_s=0.05)
    col = Collector()
    lp.start()
    lp.call_soon(lambda: time.sleep(0.2))  # keep the request queued while stopping
    lp.submit("r", [1], SamplingParams(max_tokens=1000 // 20), col)
    assert lp.stop(5)
    last = col.wait()
    assert isinstance(last, RequestFailed) and isinstance(last.error, LoopStopped)
    assert col.terminals == 1 and not engine.requests
    with pytest.raises(LoopStopped):
        lp.submit("late", [1], SamplingParams(), col)


def test_idle_loop_blocks_instead_of_spinning(loop: EngineLoop, engine: FakeEngine) -> None:
    loop.start()
    time.sleep(0.5)
    # idle_wait_s=0.05: about 10 ticks in 0.5 s (each checks has_unfinished twice); a spin would do millions
    assert engine.calls["has_unfinished"] < 60
    assert engine.calls["step"] == 0


class CountingHook:
    def __init__(self, busy: bool) -> None:
        self.ticks = 0
        self.busy = busy
        self.thread: int | None = None

    def on_tick(self) -> bool:
        self.ticks += 1
        self.thread = threading.get_ident()
        return self.busy


def test_busy_hook_is_polled_fast_idle_hook_slowly(engine: FakeEngine) -> None:
    idle, busy = CountingHook(False), CountingHook(True)
    loops = [EngineLoop(engine, name=f"hooks-{i}", idle_wait_s=0.05, busy_wait_s=0.002, hooks=[h])
             for i, h in enumerate((idle, busy))]
    for lp in loops:
        lp.start()
    time.sleep(0.3)
    for lp in loops:
        assert lp.stop(5)
    assert 2 <= idle.ticks <= 12
    assert busy.ticks > 40
    assert idle.thread == loops[0]._thread.ident  # type: ignore[union-attr]


def test_duplicate_id_is_rejected_without_touching_the_first(loop: EngineLoop) -> None:
    loop.start()
    first, dup = Collector(), Collector()
    loop.submit("same", [1], SamplingParams(max_tokens=5), first)
    loop.submit("same", [1], SamplingParams(max_tokens=5), dup)
    failed = dup.wait()
    assert isinstance(failed, RequestFailed) and isinstance(failed.error, RequestRejected)
    assert isinstance(first.wait(), RequestOutput) and first.terminals == 1


def test_wake_makes_an_idle_loop_tick_at_once(engine: FakeEngine) -> None:
    hook = CountingHook(False)
    lp = EngineLoop(engine, name="waker", idle_wait_s=5.0, hooks=[hook])
    lp.start()
    time.sleep(0.1)
    before = hook.ticks
    lp.wake()
    deadline = time.monotonic() + 2
    while hook.ticks == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hook.ticks == before + 1
    assert lp.stop(5)


class SubmitThenAbort:
    """A tick hook that submits a request and aborts it in the same tick, as a worker does when the client's
    cancel is seen right after the request was taken (its submit is still in the loop's queue then)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.col = Collector()
        self.done = False

    def on_tick(self) -> bool:
        if not self.done:
            self.done = True
            self.loop.submit("cancelled-early", [1, 2], SamplingParams(max_tokens=50), self.col)
            self.loop.abort("cancelled-early", "cancelled by the client")
        return False


def test_an_abort_before_the_submit_left_the_queue_still_aborts(engine: FakeEngine) -> None:
    lp = EngineLoop(engine, name="early-abort", idle_wait_s=0.02)
    hook = SubmitThenAbort(lp)
    lp.add_hook(hook)
    lp.start()
    last = hook.col.wait()
    assert isinstance(last, RequestFailed) and isinstance(last.error, RequestAborted)
    assert "cancelled by the client" in str(last.error)
    time.sleep(0.2)
    assert hook.col.terminals == 1 and not any(isinstance(e, RequestOutput) for e in hook.col.events)
    # never in the engine
    assert engine.calls["step"] == 0 and engine.num_free_pages == engine.num_total_pages
    later = Collector()   # the id's bookkeeping is gone: the same id submitted again runs normally
    lp.submit("cancelled-early", [1], SamplingParams(max_tokens=3), later)
    assert isinstance(later.wait(), RequestOutput) and later.terminals == 1
    assert lp.stop(5)


def test_the_loop_thread_alone_runs_at_its_nice(engine: FakeEngine) -> None:
    """``nice`` is set by the loop thread on itself (Linux: per thread): the caller's priority is untouched. A
    nice above the process's own needs no privilege."""
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    nice = min(19, caller + 3)
    lp = EngineLoop(engine, name="nice-loop", nice=nice)
    assert lp.native_id is None
    lp.start()
    try:
        col = Collector()
        lp.submit("r", [1, 2], SamplingParams(max_tokens=2), col)
        assert isinstance(col.wait(), RequestOutput)
        assert lp.native_id is not None and os.getpriority(os.PRIO_PROCESS, lp.native_id) == nice
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    finally:
        assert lp.stop(5)


_REFUSED = """
import logging, os, sys, threading
sys.path[:0] = [sys.argv[1], sys.argv[2]]
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from serving_fakes import FakeEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from serving.workers.engine_loop import EngineLoop
lp = EngineLoop(FakeEngine(), name="refused-loop", nice=-10)
lp.start()
done, finished = [], threading.Event()
def on_event(event):
    done.append(event)
    if getattr(event, "finished", False):
        finished.set()
lp.submit("r", [1], SamplingParams(max_tokens=3), on_event)
assert finished.wait(30)
print("loop", os.getpriority(os.PRIO_PROCESS, lp.native_id), "process", os.getpriority(os.PRIO_PROCESS, 0),
      "finished", done[-1].num_output_tokens)
assert lp.stop(5)
"""


def test_a_refused_nice_leaves_the_loop_serving_at_the_process_priority() -> None:
    """Without ``CAP_SYS_NICE`` (dropped here with ``setpriv`` when running as root) a nice below the
    process's is refused: the loop says so once and serves as before."""
    tests_dir = Path(__file__).resolve().parent
    cmd = [sys.executable, "-c", _REFUSED, str(tests_dir), str(tests_dir.parents[1])]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-sys_nice", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fields = next(line for line in proc.stdout.splitlines() if line.startswith("loop ")).split()
    assert fields[1] == fields[3] and fields[5] == "3", proc.stdout   # the process's priority; 3 tokens
    warnings = [line for line in proc.stdout.splitlines() if f"refused-loop keeps nice {fields[3]}" in line]
    assert len(warnings) == 1 and "CAP_SYS_NICE" in warnings[0], proc.stdout
