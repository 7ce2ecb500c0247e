"""A restarted decode server is reached at once; a decode server outlives its router's death cleanly.

Two servers and the fleet's registry: the router's (``pd_ensemble`` + ``prefill``) and a decode-only one.
Invariants: after ``kill -9`` of the decode server (requests sent while it is down fail with an error), the
same server restarted on the same ports serves the very first request sent once the router lists it healthy
(no gRPC reconnect backoff left over), with the colocated text. Then, with the decode server streaming long
requests of the router, ``kill -9`` of the whole router server (router, prefill) leaves the decode
server able to stop on SIGTERM within 15 s, without SIGKILL and with no stub killed by a fault (dmesg).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from live_client import StreamResult, grpc_generate, make_inputs, metric_value
from live_prompts import colocated_greedy_texts
from perf.server import RegistryProcess, ServeScript, fault_lines, kernel_log

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(1200)]
GREEDY = {"max_tokens": "12", "temperature": "0"}
PROMPT = "The capital of France is"
LONG = {"max_tokens": "400", "temperature": "0", "ignore_eos": "true"}
READY_S = 400.0
CLEAN_STOP_S = 15.0


class TwoServers:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.registry = RegistryProcess(tmp / "registry.log")
        self.router = ServeScript("pd_ensemble,prefill", tmp / "router.log",
                                  env={"PD_REGISTRY_URL": self.registry.url})
        self.decode = self.decode_server("decode.log")

    def decode_server(self, log: str, ports: tuple[int, ...] | None = None) -> ServeScript:
        return ServeScript("decode", self.tmp / log,
                           env={"ROLE": "decode", "PD_REGISTRY_URL": self.registry.url},
                           ports=ports)

    def healthy_decodes(self) -> int:
        text = requests.get(self.router.metrics_url, timeout=5).text
        return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
                   and 'role="decode"' in line and line.endswith(" 1"))

    def wait_decode_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.healthy_decodes() != 1:
            assert time.monotonic() < deadline, "the router does not list the decode server healthy"
            time.sleep(0.1)

    def generate(self, prompt: str = PROMPT, params: dict[str, str] = GREEDY) -> StreamResult:
        return grpc_generate(self.router.grpc_url, make_inputs(prompt, params), model="pd_ensemble")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoServers]:
    pytest.importorskip("pytriton")
    s = TwoServers(tmp_path_factory.mktemp("restart"))
    try:
        s.registry.start()
        s.router.start(READY_S)
        s.decode.start(READY_S)
        yield s
    finally:
        s.decode.stop(40.0)
        s.router.stop(40.0)
        s.registry.stop()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts([PROMPT], GREEDY)


def test_a_restarted_decode_server_serves_the_first_request(servers: TwoServers, reference) -> None:
    servers.wait_decode_healthy()
    assert servers.generate().text == reference[PROMPT]
    servers.decode.kill()
    down = [servers.generate() for _ in range(3)]   # fail while it is down (and grow a reconnect backoff)
    assert all(r.error for r in down), [r.text for r in down]
    servers.decode = servers.decode_server("decode_restarted.log", servers.decode.ports)
    servers.decode.start(READY_S)
    servers.wait_decode_healthy()
    first = servers.generate()
    assert first.error is None and first.text == reference[PROMPT], first.error


def test_a_decode_server_stops_cleanly_after_its_router_was_killed(servers: TwoServers) -> None:
    servers.wait_decode_healthy()
    stubs = servers.decode.stub_pids()
    kernel_before = kernel_log()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(servers.generate, f"Story {i}:", LONG) for i in range(4)]
        deadline = time.monotonic() + 120
        while metric_value(servers.decode.metrics_url, "pd_queue_requests", model="decode",
                           queue="running") < 4:
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.1)
        time.sleep(1.0)   # decoding
        servers.router.kill()
        results = [f.result(timeout=120) for f in futures]
    assert all(r.error for r in results)   # their router died: each stream ended with an error
    elapsed_s, killed = servers.decode.stop(40.0)
    assert not killed and elapsed_s < CLEAN_STOP_S, \
        f"decode stop took {elapsed_s:.1f} s (killed={killed}):\n{servers.decode.log_tail()}"
    kernel_after = kernel_log()
    if kernel_before is not None and kernel_after is not None:
        seen = set(kernel_before)
        assert not fault_lines([line for line in kernel_after if line not in seen], stubs)
