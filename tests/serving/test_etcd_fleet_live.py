"""PD across tritonservers with fleet membership in a real etcd (``PD_REGISTRY_URL=etcd://host:port``): a
router-only server (``pd_ensemble``) and a worker server (``prefill`` + ``decode``) announce and find each
other through etcd leases; the router then asks each worker's own rendezvous for its load.

Invariants: greedy text through the router equals the colocated engine's; ``kill -9`` of etcd only freezes
membership: requests keep succeeding on the last view (no request path goes through the store); etcd started
again on its data, the fleet is still whole and serving; a second worker server that joins while etcd is back
is seen by the router and serves requests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from live_client import StreamResult, finished_requests, grpc_generate, make_inputs, streams_match_reference
from live_prompts import PROMPTS, colocated_greedy_texts
from perf.server import ServeScript

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bootstrap"))
from membership_stores import ETCD, NO_ETCD, EtcdProcess  # noqa: E402 - tests/bootstrap on sys.path

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
GREEDY = {"max_tokens": "12", "temperature": "0"}
READY_S = 240.0


class EtcdFleet:
    def __init__(self, tmp: Path) -> None:
        assert ETCD is not None, NO_ETCD
        self.etcd = EtcdProcess(tmp)
        env = {"PD_REGISTRY_URL": self.etcd.url}
        self.router = ServeScript("pd_ensemble", tmp / "router.log", env={**env, "ROLE": "router"})
        self.workers = ServeScript("prefill,decode", tmp / "workers.log", env={**env, "OPENAI": "0"})
        self.workers_b = ServeScript("prefill,decode", tmp / "workers_b.log", env={**env, "OPENAI": "0"})

    def healthy(self, role: str) -> int:
        text = requests.get(self.router.metrics_url, timeout=5).text
        return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
                   and f'role="{role}"' in line and line.endswith(" 1"))

    def wait_healthy(self, instances: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy("prefill") == instances and self.healthy("decode") == instances:
                return
            time.sleep(0.2)
        raise AssertionError(f"router sees {self.healthy('prefill')} prefill / {self.healthy('decode')} "
                             f"decode, not {instances} of each")

    def generate(self, prompt: str) -> StreamResult:
        return grpc_generate(self.router.grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdFleet]:
    pytest.importorskip("pytriton")
    f = EtcdFleet(tmp_path_factory.mktemp("etcd_fleet"))
    try:
        f.etcd.start()
        f.workers.start(READY_S)
        f.router.start(READY_S)
        yield f
    finally:
        for server in (f.workers_b, f.workers, f.router):
            server.stop(40.0)
        f.etcd.stop()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS, GREEDY)


def test_router_finds_the_workers_through_etcd_and_gives_the_colocated_text(
        fleet: EtcdFleet, reference) -> None:
    fleet.wait_healthy(1)
    streams_match_reference(fleet.generate, PROMPTS, reference)


def test_a_killed_etcd_freezes_membership_and_requests_keep_succeeding(fleet: EtcdFleet, reference) -> None:
    fleet.wait_healthy(1)
    fleet.etcd.kill()
    time.sleep(12.0)   # past the router's 10 s grace for members its store stops listing: its last view holds
    streams_match_reference(fleet.generate, PROMPTS, reference)
    assert fleet.healthy("prefill") == 1 and fleet.healthy("decode") == 1
    fleet.etcd.start()   # the same data dir: the workers' keep-alives find their leases or grant new ones
    fleet.wait_healthy(1)
    streams_match_reference(fleet.generate, PROMPTS, reference)


def test_a_worker_server_that_joins_through_etcd_is_used(fleet: EtcdFleet, reference) -> None:
    fleet.workers_b.start(READY_S)
    fleet.wait_healthy(2)
    before = _finished(fleet.workers_b, "prefill")
    deadline = time.monotonic() + 120
    while _finished(fleet.workers_b, "prefill") == before:   # the least-loaded pick reaches it
        assert time.monotonic() < deadline, "the joined worker server got no request"
        result = fleet.generate(PROMPTS[0])
        assert (result.error, result.text) == (None, reference[PROMPTS[0]])


def _finished(server: ServeScript, model: str) -> float:
    return finished_requests(server.metrics_url, model)
