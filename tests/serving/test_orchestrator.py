"""PDOrchestrator merges the prefill and decode streams of one room; each test states one invariant."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving.orchestrator import (
    ChildResponse,
    OutputChunk,
    PDOrchestrator,
    RoomAllocator,
    RoundRobinPairing,
)


class Children:
    """Scripted child streams: per role, a list of (delay_s, ChildResponse)."""

    def __init__(self, prefill: list, decode: list) -> None:
        self.script = {"prefill": prefill, "decode": decode}
        self.rooms: dict[str, int] = {}
        self.aborted: list[tuple[int, str]] = []

    def launch(self, call):
        self.rooms[call.role] = call.room
        assert call.prefill_model == "prefill"
        for delay_s, response in self.script[call.role]:
            time.sleep(delay_s)
            yield response

    def abort_room(self, room: int, reason: str) -> None:
        self.aborted.append((room, reason))


def run(children: Children, cancel_after_s: float | None = None, idle_timeout_s: float = 300.0) -> list[OutputChunk]:
    out: list[OutputChunk] = []
    start = time.monotonic()

    def cancelled() -> bool:
        return cancel_after_s is not None and time.monotonic() - start > cancel_after_s

    pool = ThreadPoolExecutor(4)
    orchestrator = PDOrchestrator(RoundRobinPairing(["prefill"], ["decode"]), RoomAllocator(),
                                  children.abort_room, pool, idle_timeout_s=idle_timeout_s)
    orchestrator.generate(children.launch, out.append, cancelled)
    pool.shutdown(wait=False)  # a reader may still drain a child stream, as it does in the server
    return out


def tok(text: str, n: int, final: bool = False, finish_reason: str | None = None) -> ChildResponse:
    return ChildResponse(text=text, num_input_tokens=7, num_output_tokens=n, final=final,
                         finish_reason=finish_reason)


def test_first_token_comes_first_even_when_decode_answers_earlier():
    children = Children(prefill=[(0.1, tok("A", 1)), (0, ChildResponse(final=True))],
                        decode=[(0, tok("B", 2)), (0, tok("C", 3, final=True, finish_reason="length"))])
    out = run(children)
    assert [c.text for c in out if not c.final] == ["A", "B", "C"]
    assert out[-1].final and out[-1].finish_reason == "length"
    assert (out[-1].num_input_tokens, out[-1].num_output_tokens) == (7, 3)
    assert sum(c.final for c in out) == 1
    assert children.rooms["prefill"] == children.rooms["decode"]
    assert children.aborted == []


def test_decode_error_aborts_the_room_and_ends_with_one_final_error():
    children = Children(prefill=[(0.5, tok("A", 1, final=True))],
                        decode=[(0, ChildResponse(error="prompt too long", final=True))])
    out = run(children)
    assert len(out) == 1 and out[0].final and out[0].error == "prompt too long"
    assert [room for room, _ in children.aborted] == [children.rooms["decode"]]


def test_a_child_stream_that_raises_becomes_an_error_not_a_hang():
    def broken(call):
        raise RuntimeError("model not ready")

    children = Children(prefill=[], decode=[])
    children.launch = broken
    out = run(children)
    assert out[-1].final and "model not ready" in out[-1].error


def test_client_cancel_aborts_the_room():
    children = Children(prefill=[(0, tok("A", 1))], decode=[(5.0, tok("B", 2, final=True))])
    start = time.monotonic()
    out = run(children, cancel_after_s=0.1)
    assert time.monotonic() - start < 4.0
    assert out[-1].final and out[-1].finish_reason == "abort"
    assert len(children.aborted) == 1 and "cancel" in children.aborted[0][1]


def test_rooms_are_unique_63_bit_and_released():
    rooms = RoomAllocator()
    got = {rooms.allocate() for _ in range(1000)}
    assert len(got) == 1000 and all(0 <= r < 2**63 for r in got)
    for r in got:
        rooms.release(r)
    assert len(rooms) == 0


def test_round_robin_covers_xpyd_pairs():
    pairing = RoundRobinPairing(["p0", "p1"], ["d0"])
    assert [pairing.next_pair() for _ in range(4)] == [("p0", "d0"), ("p1", "d0"), ("p0", "d0"), ("p1", "d0")]
    with pytest.raises(ValueError):
        RoundRobinPairing([], ["d0"])


def test_pairing_is_thread_safe():
    pairing = RoundRobinPairing(["p0", "p1"], ["d0", "d1"])
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def worker():
        for _ in range(100):
            pair = pairing.next_pair()
            with lock:
                seen.append(pair)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen.count(("p0", "d0")) == 200 and seen.count(("p1", "d1")) == 200


def test_children_that_go_silent_end_the_request_with_an_error_after_the_idle_timeout():
    children = Children(prefill=[(0, tok("A", 1))], decode=[(30.0, tok("B", 2, final=True))])
    start = time.monotonic()
    out = run(children, idle_timeout_s=0.3)
    assert time.monotonic() - start < 5.0
    assert out[-1].final and "no response" in out[-1].error and sum(c.final for c in out) == 1
    assert len(children.aborted) == 1
