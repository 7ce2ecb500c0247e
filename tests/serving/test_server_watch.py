"""ServerShutdownWatch: armed by one "ready", fires once after consecutive misses, never before it was armed."""

from __future__ import annotations

import threading

from serving.server_watch import ServerShutdownWatch


def run(answers: list[object], misses: int = 2) -> int:
    """Play ``answers`` (True/False, or an exception = unreachable) and return how often on_shutdown ran."""
    fired = threading.Event()
    calls = []
    script = iter(answers)

    def is_ready() -> bool:
        try:
            answer = next(script)
        except StopIteration:
            fired.set()
            return True
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    watch = ServerShutdownWatch("t", "127.0.0.1:1", lambda: (calls.append(1), fired.set()), interval_s=0.001,
                                misses=misses, is_ready=is_ready).start()
    fired.wait(5)
    watch.stop()
    return len(calls)


def test_not_ready_before_ever_ready_is_loading_not_shutdown() -> None:
    assert run([False] * 20) == 0


def test_two_misses_after_ready_mean_shutdown_once() -> None:
    assert run([True, False, OSError("refused"), False, False]) == 1


def test_a_single_miss_is_forgiven() -> None:
    assert run([True, False, True, False, True]) == 0
