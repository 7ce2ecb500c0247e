"""ServerShutdownWatch: armed by one "live", fires once after consecutive misses, never before it was armed."""

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
