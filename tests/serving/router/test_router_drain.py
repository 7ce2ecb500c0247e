"""``Router.drain`` (a server stop): new requests are refused at once, readiness turns false, the open
requests run to their end; ``stop`` then ends what a drain timeout left, each with one FINAL. A whole
``Router`` on its own loop thread over a scripted launcher."""

from __future__ import annotations

import threading
import time

from router_fakes import ScriptedLauncher, status

from serving.delta import Delta
from serving.parsing.request import GenerateRequest
from serving.router.config import RouterConfig
from serving.router.discovery import FleetMember
from serving.router.fleet import FleetSnapshot
from serving.router.orchestrator import RoutedRequest
from serving.router.service import Router

FLEET = (status("p0@h:1", "prefill"), status("d0@h:1", "decode"))
PREFILL = [(0.0, Delta(text="A", num_input_tokens=7, num_output_tokens=1)), (0.0, Delta(final=True))]


def decode_taking(seconds: float) -> list[tuple[float, Delta]]:
    last = Delta(text="B", num_input_tokens=7, num_output_tokens=2, final=True, finish_reason="length")
    return [(seconds, last)]


class NoMembers:
    def members(self) -> tuple[list[FleetMember], bool]:
        return [], True

    def forget(self, instance_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class Stream:
    """One client stream: its chunks, and an event set at its FINAL."""

    def __init__(self) -> None:
        self.chunks: list[Delta] = []
        self.done = threading.Event()

    def emit(self, chunk: Delta) -> None:
        self.chunks.append(chunk)
        if chunk.final:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


def started_router(decode_s: float) -> Router:
    # a long refresh: the watcher reads the (empty) members once at start; the test sets the fleet itself
    config = RouterConfig(policy="round_robin", fleet_refresh_s=3600.0, tokenizer="")
    launcher = ScriptedLauncher({"prefill": PREFILL, "decode": decode_taking(decode_s)})
    router = Router(config, "test", launcher=launcher, count_tokens=lambda request: 7, members=NoMembers())
    router.start()
    router.fleet.update(FleetSnapshot(FLEET, taken_s=time.monotonic()))
    return router


def submit(router: Router) -> Stream:
    stream = Stream()
    routed = RoutedRequest(GenerateRequest(prompt="hi"), {"text_input": b"hi"})
    router.submit(routed, stream.emit, lambda: False)
    return stream


def test_a_drain_refuses_new_requests_and_lets_the_open_ones_finish() -> None:
    router = started_router(decode_s=0.6)
    try:
        open_streams = [submit(router) for _ in range(3)]
        time.sleep(0.1)
        assert router.ready() and router.num_requests == 3
        began = time.monotonic()
        drained: list[int] = []
        drainer = threading.Thread(target=lambda: drained.append(router.drain(10.0)))
        drainer.start()
        time.sleep(0.05)
        late = submit(router)
        assert late.done.wait(2) and "draining" in (late.chunks[-1].error or "") and not router.ready()
        drainer.join(10)
        assert drained == [0] and time.monotonic() - began < 3.0
        for stream in open_streams:
            assert stream.done.is_set() and stream.chunks[-1].error is None and stream.text == "AB"
            assert sum(c.final for c in stream.chunks) == 1
    finally:
        router.stop(5.0)


def test_a_drain_that_times_out_leaves_the_rest_to_stop_which_ends_each_with_one_final() -> None:
    router = started_router(decode_s=30.0)
    try:
        streams = [submit(router) for _ in range(2)]
        time.sleep(0.1)
        began = time.monotonic()
        assert router.drain(0.3) == 2 and time.monotonic() - began < 1.0
    finally:
        router.stop(5.0)
    for stream in streams:
        assert stream.done.wait(2) and "shutting down" in (stream.chunks[-1].error or "")
        assert sum(c.final for c in stream.chunks) == 1
