"""Stops that lose nothing (issue #50 item 1): SIGTERM or Ctrl-C to one server of a 2P2D fleet (a registry, a
router server, two prefill and two decode servers, each ``scripts/serve.sh`` with one role, the tiny model)
while it serves streams; every stream ends with all its tokens and one FINAL, no error.

- a prefill server (SIGINT, Ctrl-C's signal) while long prompts are being prefilled: the rooms it started
  finish there, new ones go to the other prefill;
- a decode server (SIGTERM) mid-stream: the router moves its streams to the other decode (migration), so the
  server exits long before the streams would have ended;
- the router's server (SIGTERM) mid-stream: it admits nothing more (a new request is refused at once) and its
  open streams run to their end, then it exits.

Each stopped server exits by itself (no SIGKILL) within its drain timeout. Lean: the tiny model (compute
nearly free), 4-8 streams.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from live_client import StreamResult, grpc_generate, make_inputs, metric_value
from perf.server import Deployment, RegistryProcess, ServeScript, build_model_repository

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
READY_S = 300.0
DRAIN_S = 30
STREAM = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
SHORT = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
#: ~2800 tokens, prefilled 16 at a time, one chunk per step (the prefill servers' chunk_size and
#: max_num_batched_tokens): 12 such prompts keep each prefill server busy for a second or more
LONG_PROMPT = "The river wound through the valley, past orchards and stone bridges. " * 200


class Fleet:
    def __init__(self, tmp: Path) -> None:
        from perf.tiny_model import build_tiny_llama

        tiny = str(build_tiny_llama(tmp / "tiny"))
        decode = {"model": tiny, "num_pages": "2048"}
        prefill = {**decode, "chunk_size": "16", "max_num_batched_tokens": "16"}
        overrides = {"prefill": prefill, "decode": decode, "pd_ensemble": {"tokenizer": tiny}}
        repo = build_model_repository(Deployment("pd", "pd_ensemble", ("pd_ensemble", "prefill", "decode"),
                                                 overrides=overrides), tmp / "models")
        self.registry = RegistryProcess(tmp / "registry.log")
        env = {"PD_REGISTRY_URL": self.registry.url, "DRAIN_TIMEOUT_S": str(DRAIN_S)}

        def server(role: str, model: str, name: str) -> ServeScript:
            return ServeScript(model, tmp / f"{name}.log", repo, env={**env, "ROLE": role})

        self.router = server("router", "pd_ensemble", "router")
        self.prefills = [server("prefill", "prefill", f"prefill_{i}") for i in range(2)]
        self.decodes = [server("decode", "decode", f"decode_{i}") for i in range(2)]

    @property
    def servers(self) -> list[ServeScript]:
        return [self.router, *self.prefills, *self.decodes]

    def start(self) -> None:
        self.registry.start()
        with ThreadPoolExecutor(5) as pool:
            list(pool.map(lambda s: s.start(READY_S), self.servers))
        self.wait_healthy(2, 2)

    def healthy(self, role: str) -> int:
        text = requests.get(self.router.metrics_url, timeout=5).text
        return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
                   and f'role="{role}"' in line and line.endswith(" 1"))

    def wait_healthy(self, prefills: int, decodes: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.healthy("prefill"), self.healthy("decode")) != (prefills, decodes):
            seen = f"{self.healthy('prefill')}P {self.healthy('decode')}D"
            assert time.monotonic() < deadline, f"router sees {seen}"
            time.sleep(0.2)

    def generate(self, prompt: str, on_first_text=None, params=STREAM) -> StreamResult:
        return grpc_generate(self.router.grpc_url, make_inputs(prompt, params), model="pd_ensemble",
                             on_first_text=on_first_text)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(60.0)
        self.registry.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    pytest.importorskip("pytriton")
    f = Fleet(tmp_path_factory.mktemp("drain"))
    try:
        f.start()
        yield f
    finally:
        f.stop()


def signal_and_time(server: ServeScript, signum: int) -> tuple[threading.Thread, dict[str, float]]:
    """Send ``signum`` to the server's serve.sh alone (as a supervisor does) and time its exit on a thread."""
    proc = server._proc
    assert proc is not None
    out: dict[str, float] = {}
    began = time.monotonic()
    os.kill(proc.pid, signum)

    def wait() -> None:
        proc.wait(DRAIN_S + 40)
        out["stop_s"] = time.monotonic() - began
        out["exit_s"] = time.monotonic()
    thread = threading.Thread(target=wait)
    thread.start()
    return thread, out


def streams_under(fleet: Fleet, prompts: list[str], first_texts: int,
                  params: dict = STREAM) -> tuple[list, threading.Event]:
    """Start one stream per prompt; the event is set once ``first_texts`` of them have sent text."""
    seen, lock, event = [0], threading.Lock(), threading.Event()

    def on_first() -> None:
        with lock:
            seen[0] += 1
            if seen[0] >= first_texts:
                event.set()
    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(fleet.generate, p, on_first, params) for p in prompts]
    pool.shutdown(wait=False)
    return futures, event


def assert_complete(results: list[StreamResult], params: dict = STREAM) -> None:
    for res in results:
        assert res.error is None and res.final_seen, res.error
        assert res.num_output_tokens[-1] == params["max_tokens"] and res.finish_reasons[-1] == "length"


def migrations(fleet: Fleet) -> float:
    try:
        return metric_value(fleet.router.metrics_url, "pd_router_migrations_total")
    except KeyError:   # the series appears with the first migration
        return 0.0


def pages_in_use(server: ServeScript, model: str) -> float:
    return (metric_value(server.metrics_url, "pd_kv_total_pages", model=model)
            - metric_value(server.metrics_url, "pd_kv_free_pages", model=model))


def drained_line(server: ServeScript) -> tuple[int, int]:
    """(requests in flight when its drain began, requests its drain left) from the server's log: the server
    watch's drain and then ``finalize``'s (what is left by then) each log both."""
    text = server.log_path.read_text(errors="replace")
    began = re.findall(r"draining: (\d+) requests in flight", text)
    left = re.findall(r"drained in [\d.]+ s \((\d+) requests left", text)
    assert began and left, server.log_tail()
    return max(int(n) for n in began), int(left[-1])


def test_ctrl_c_to_a_prefill_server_finishes_the_rooms_it_started(fleet: Fleet) -> None:
    prompts = [f"Report {i}. {LONG_PROMPT}" for i in range(12)]
    futures, _ = streams_under(fleet, prompts, first_texts=1, params=SHORT)
    stopped = fleet.prefills[1]
    deadline = time.monotonic() + 60
    while pages_in_use(stopped, "prefill") == 0:   # it has rooms in flight
        assert time.monotonic() < deadline, "the prefill server got no room"
        time.sleep(0.01)
    waiter, timing = signal_and_time(stopped, signal.SIGINT)
    results = [f.result(timeout=300) for f in futures]
    waiter.join()
    assert_complete(results, SHORT)
    assert stopped._proc is not None and stopped._proc.returncode is not None
    assert timing["stop_s"] < DRAIN_S, timing
    in_flight, left = drained_line(stopped)
    assert in_flight >= 1 and left == 0, (in_flight, left)
    print(f"prefill stop: {timing['stop_s']:.1f} s, {in_flight} requests in flight at the drain's start")
    stopped._proc = None
    fleet.wait_healthy(1, 2)


def test_sigterm_to_a_decode_server_moves_its_streams_to_the_other_decode(fleet: Fleet) -> None:
    moved_before = migrations(fleet)
    futures, first = streams_under(fleet, [f"Story {i}:" for i in range(4)], first_texts=4)
    assert first.wait(120)
    time.sleep(0.5)
    stopped = fleet.decodes[1]
    waiter, timing = signal_and_time(stopped, signal.SIGTERM)
    results = [f.result(timeout=300) for f in futures]
    ended_s = max(r.end_s for r in results if r.end_s)
    waiter.join()
    assert_complete(results)
    in_flight, left = drained_line(stopped)
    moved = migrations(fleet) - moved_before
    print(f"decode stop: {timing['stop_s']:.1f} s with {in_flight} streams on it; {moved:.0f} moved; the "
          f"streams ended {ended_s - timing['exit_s']:.1f} s after its exit")
    assert in_flight >= 1 and moved >= in_flight and left == 0
    assert timing["exit_s"] < ended_s, "the decode waited its streams out instead of handing them over"
    stopped._proc = None
    fleet.wait_healthy(1, 1)


def test_sigterm_to_the_router_server_refuses_new_requests_and_finishes_its_streams(fleet: Fleet) -> None:
    futures, first = streams_under(fleet, [f"Poem {i}:" for i in range(4)], first_texts=4)
    assert first.wait(120)
    stopped = fleet.router
    waiter, timing = signal_and_time(stopped, signal.SIGTERM)
    time.sleep(1.5)
    refused_s = time.monotonic()
    late = grpc_generate(stopped.grpc_url, make_inputs("late", {"max_tokens": 4}), model="pd_ensemble")
    assert late.error is not None and time.monotonic() - refused_s < 5.0, late
    results = [f.result(timeout=300) for f in futures]
    ended_s = max(r.end_s for r in results if r.end_s)
    waiter.join()
    assert_complete(results)
    print(f"router stop: {timing['stop_s']:.1f} s, exited {timing['exit_s'] - ended_s:.1f} s after its last "
          f"stream ended; a new request during the drain: {late.error[:120]}")
    assert timing["exit_s"] >= ended_s and timing["stop_s"] < DRAIN_S + 15
    stopped._proc = None
