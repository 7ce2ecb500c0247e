"""An engine that fails for good (a tensor-parallel rank died: ``TensorParallelError``) ends its instance as a
dead stub does (issue #45 item 3).

Invariants: the engine loop fails every request in flight with the error first, then calls ``on_fatal`` once
(a later failing step does not call it again); an ordinary step failure fails the requests only;
``exit_process_soon`` ends the process with ``EXIT_STATUS`` after its grace, not before.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving_fakes import FakeEngine

from engine.errors import EngineError, TensorParallelError
from engine.sampling_params import SamplingParams
from serving.events import LoopEvent, RequestFailed
from serving.workers.engine_loop import EngineLoop
from serving.workers.fatal import EXIT_STATUS

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]


def run_failing_loop(error: Exception) -> tuple[list[LoopEvent], list[EngineError], list[bool]]:
    """Two requests on a loop whose steps raise ``error``: (their events, ``on_fatal``'s calls, whether the
    requests had failed when it was called)."""
    engine = FakeEngine()
    events: list[LoopEvent] = []
    fatal: list[EngineError] = []
    failed_first: list[bool] = []
    done = threading.Event()

    def on_fatal(e: EngineError) -> None:
        failed_first.append(sum(isinstance(x, RequestFailed) for x in events) == 2)
        fatal.append(e)

    def step() -> list:
        raise error

    engine.step = step   # type: ignore[method-assign]
    loop = EngineLoop(engine, name="fatal-loop", idle_wait_s=0.02, on_fatal=on_fatal)
    loop.start()
    try:
        for rid in ("a", "b"):
            loop.submit(rid, [1, 2], SamplingParams(max_tokens=3), lambda e: (events.append(e), done.set()))
        deadline = time.monotonic() + 5
        while sum(isinstance(x, RequestFailed) for x in events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.submit("c", [1], SamplingParams(max_tokens=2), events.append)   # fails again: no second call
        time.sleep(0.2)
    finally:
        loop.stop(5)
    return events, fatal, failed_first


def test_a_dead_rank_fails_every_request_then_calls_on_fatal_once() -> None:
    error = TensorParallelError("rank 1 (pid 9) was killed by signal 9")
    events, fatal, failed_first = run_failing_loop(error)
    assert [type(e) for e in events[:2]] == [RequestFailed, RequestFailed]
    assert "killed by signal 9" in str(events[0].error)
    assert len(fatal) == 1 and isinstance(fatal[0], TensorParallelError) and failed_first == [True]


def test_an_ordinary_step_failure_fails_the_requests_only() -> None:
    events, fatal, _ = run_failing_loop(RuntimeError("boom"))
    assert sum(isinstance(e, RequestFailed) for e in events) >= 2 and fatal == []


def test_exit_process_soon_ends_the_process_with_its_status_after_the_grace() -> None:
    code = ("import time, sys; from serving.workers.fatal import exit_process_soon; "
            "exit_process_soon(RuntimeError('rank died'), grace_s=0.5); print('alive', flush=True); "
            "time.sleep(10); print('not reached', flush=True)")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert out.returncode == EXIT_STATUS and out.stdout.split() == ["alive"]
    assert 0.5 <= time.monotonic() - start < 8
