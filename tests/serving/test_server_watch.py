"""ServerShutdownWatch: armed by one "live", fires once after consecutive misses, never before it was
armed."""

from __future__ import annotations

import threading

from serving.triton.server_watch import ServerShutdownWatch


def run(answers: list[object], misses: int = 2) -> int:
    """Play ``answers`` (True/False, or an exception = unreachable) and return how often on_shutdown ran."""
    fired = threading.Event()
    calls = []
    script = iter(answers)

    def is_live() -> bool:
        try:
            answer = next(script)
        except StopIteration:
            fired.set()
            return True
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    watch = ServerShutdownWatch("t", "127.0.0.1:1", lambda: (calls.append(1), fired.set()), interval_s=0.001,
                                misses=misses, is_live=is_live).start()
    fired.wait(5)
    watch.stop()
    return len(calls)


def test_not_live_before_ever_live_is_start_up_not_shutdown() -> None:
    assert run([False] * 20) == 0


def test_two_misses_after_live_mean_shutdown_once() -> None:
    assert run([True, False, OSError("refused"), False, False]) == 1


def test_a_single_miss_is_forgiven() -> None:
    assert run([True, False, True, False, True]) == 0


def test_server_exiting_means_shutdown_at_the_first_answer() -> None:
    """tritonserver answers liveness with ``UNAVAILABLE: Server exiting`` from the first moment of its stop:
    one such answer is enough (the drain begins at once), where an unreachable endpoint needs two misses."""
    assert run([True, RuntimeError("[StatusCode.UNAVAILABLE] Server exiting"), True, True]) == 1
    assert run([True, OSError("connection refused"), True, True]) == 0


def run_unload(ready_answers: list[object], misses: int = 2) -> tuple[int, int]:
    """The server stays live; the model's readiness plays ``ready_answers`` (True/False or an exception: an
    unknown model). Returns (on_unload calls, on_shutdown calls)."""
    done = threading.Event()
    unloads, shutdowns = [], []
    script = iter(ready_answers)

    def is_model_ready() -> bool:
        try:
            answer = next(script)
        except StopIteration:
            done.set()
            return True
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    watch = ServerShutdownWatch("t", "127.0.0.1:1", lambda: shutdowns.append(1), interval_s=0.001,
                                misses=misses, is_live=lambda: True, model="decode",
                                on_unload=lambda: unloads.append(1),
                                is_model_ready=is_model_ready).start()
    done.wait(5)
    watch.stop()
    return len(unloads), len(shutdowns)


def test_a_model_that_reads_not_ready_on_a_live_server_is_being_unloaded_once() -> None:
    """An unload that tritonserver does not finalize at once (it waits for the model's requests, or a client's
    late cancel holds the model): the instance learns it and stops serving, once; the server is no stop."""
    assert run_unload([True, False, RuntimeError("unknown model"), False, True, False, False]) == (1, 0)


def test_a_model_still_loading_or_ready_again_within_a_check_is_not_unloaded() -> None:
    assert run_unload([False, False, False]) == (0, 0)   # never ready yet: its own start
    assert run_unload([True, False, True, False, True]) == (0, 0)   # one miss at a time: a reload's swap
