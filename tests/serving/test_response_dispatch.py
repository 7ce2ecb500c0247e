"""ResponseDispatcher: producers only queue; one thread sends in order, polls cancellation, never touches a
sender after FINAL, and drains what is queued on stop. Fake senders, no Triton."""

from __future__ import annotations

import threading
import time

from serving.response_dispatch import ResponseDispatcher

FINAL = 1


class FakeSender:
    def __init__(self, block: threading.Event | None = None) -> None:
        self.sent: list[tuple[object, int]] = []
        self.cancelled = False
        self.calls_after_final = 0
        self.block = block

    def send(self, response: object = None, flags: int = 0) -> None:
        if self.block is not None:
            self.block.wait(10)
        if self.sent and self.sent[-1][1] == FINAL:
            self.calls_after_final += 1
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        if self.sent and self.sent[-1][1] == FINAL:
            self.calls_after_final += 1
        return self.cancelled


def started(poll_s: float = 0.01) -> ResponseDispatcher:
    dispatcher = ResponseDispatcher("test", FINAL, cancel_poll_interval_s=poll_s)
    dispatcher.start()
    return dispatcher


def test_responses_go_out_in_order_and_nothing_touches_a_sender_after_final() -> None:
    dispatcher, sender = started(), FakeSender()
    handle = dispatcher.open(sender, "r1")
    for i in range(50):
        dispatcher.submit(handle, lambda i=i: f"chunk{i}", final=False)
    dispatcher.submit(handle, None, final=True)
    dispatcher.submit(handle, lambda: "late", final=False)   # dropped: after FINAL
    time.sleep(0.1)   # several cancel polls after FINAL
    assert dispatcher.stop(5.0)
    assert [r for r, _ in sender.sent] == [f"chunk{i}" for i in range(50)] + [None]
    assert sender.sent[-1][1] == FINAL and sender.calls_after_final == 0


def test_cancellation_is_polled_and_cached_for_the_producer() -> None:
    dispatcher, sender = started(), FakeSender()
    handle = dispatcher.open(sender)
    assert not handle.cancelled
    sender.cancelled = True
    deadline = time.monotonic() + 2.0
    while not handle.cancelled and time.monotonic() < deadline:
        time.sleep(0.005)
    assert handle.cancelled
    dispatcher.stop(5.0)


def test_a_stuck_sender_never_blocks_the_producer_and_stop_drains_the_queue() -> None:
    release = threading.Event()
    dispatcher, stuck = started(), FakeSender(block=release)
    handle = dispatcher.open(stuck)
    started_s = time.monotonic()
    for _ in range(100):
        dispatcher.submit(handle, lambda: "x", final=False)
    dispatcher.submit(handle, None, final=True)
    assert time.monotonic() - started_s < 0.5          # queueing is all the producer does
    assert dispatcher.queued > 0
    release.set()
    assert dispatcher.stop(10.0)
    assert len(stuck.sent) == 101 and stuck.sent[-1][1] == FINAL
