"""PD across tritonservers: a router-only server (``pd_ensemble`` + the fleet's bootstrap service), prefill-only
and decode-only servers on other ports, found by the router at the bootstrap service.

Invariants: greedy text through the router equals the colocated engine's; with a second prefill server (2P1D,
both serving a model named ``prefill``) both receive requests, and a conversation's next turns go back to the
prefill server holding its prefix (cache-aware pairing); ``kill -9`` of one prefill server while requests
are in flight: every request that had no first token yet completes on the other one, and every later one goes
there; started again, it rejoins and serves; every surviving pool is back at its size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from live_client import StreamResult, grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import PROMPTS as BASE_PROMPTS
from live_prompts import colocated_greedy_texts
from perf.server import ServeScript

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
GREEDY = {"max_tokens": "12", "temperature": "0"}
PROMPTS = BASE_PROMPTS + ["Name the planets of the solar system:", "x"]
#: long prompts for the kill: their prefill takes long enough to be in flight when the server dies
LONG = [f"Story {i}: " + "The river wound through the valley, past orchards and stone bridges. " * 60
        + "What flows through the valley?" for i in range(6)]
READY_S = 240.0


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.router = ServeScript("pd_ensemble", tmp / "router.log", env={"ROLE": "router", "BOOTSTRAP": "1"})
        env = {"PD_BOOTSTRAP_URL": self.router.bootstrap_url}
        self.decode = ServeScript("decode", tmp / "decode.log", env={**env, "ROLE": "decode"})
        self.prefill_a = ServeScript("prefill", tmp / "prefill_a.log", env={**env, "ROLE": "prefill"})
        self.prefill_b = ServeScript("prefill", tmp / "prefill_b.log", env={**env, "ROLE": "prefill"})
        self.env = env

    def healthy(self, role: str) -> int:
        text = __import__("requests").get(self.router.metrics_url, timeout=5).text
        return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
                   and f'role="{role}"' in line and line.endswith(" 1"))

    def wait_healthy(self, prefills: int, decodes: int = 1, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy("prefill") == prefills and self.healthy("decode") == decodes:
                return
            time.sleep(0.2)
        raise AssertionError(f"router sees {self.healthy('prefill')} prefill / {self.healthy('decode')} decode")

    def generate(self, prompt: str) -> StreamResult:
        return grpc_generate(self.router.grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble")

    def stop(self) -> None:
        for server in (self.prefill_b, self.prefill_a, self.decode, self.router):
            server.stop(40.0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    pytest.importorskip("pytriton")
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        f.router.start(READY_S)
        f.decode.start(READY_S)
        f.prefill_a.start(READY_S)
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS + LONG, GREEDY)


def served(server: ServeScript, model: str) -> float:
    try:
        return metric_value(server.metrics_url, "pd_requests_total", model=model, outcome="finished")
    except KeyError:
        return 0.0


def pools_full(*servers: tuple[ServeScript, str]) -> bool:
    return all(metric_value(s.metrics_url, "pd_kv_free_pages", model=m)
               == metric_value(s.metrics_url, "pd_kv_total_pages", model=m) for s, m in servers)


def wait_pools_full(*servers: tuple[ServeScript, str], timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pools_full(*servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pools_full(*servers)


def test_router_prefill_and_decode_in_three_servers_give_the_colocated_text(fleet: Fleet, reference) -> None:
    fleet.wait_healthy(prefills=1)
    streams_match_reference(fleet.generate, PROMPTS, reference)
    assert served(fleet.prefill_a, "prefill") == len(PROMPTS)


def test_2p1d_across_servers_uses_both_prefill_servers(fleet: Fleet, reference) -> None:
    fleet.prefill_b.start(READY_S)
    fleet.wait_healthy(prefills=2)
    before = served(fleet.prefill_a, "prefill"), served(fleet.prefill_b, "prefill")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(fleet.generate, PROMPTS * 2))
    assert all(r.error is None and r.text == reference[p] for p, r in zip(PROMPTS * 2, results))
    after = served(fleet.prefill_a, "prefill"), served(fleet.prefill_b, "prefill")
    assert after[0] > before[0] and after[1] > before[1], (before, after)


def test_cache_aware_pairing_sends_a_conversation_back_to_its_prefill(fleet: Fleet) -> None:
    """The default policy (cache_aware) on an idle 2P1D fleet: each next turn of a conversation (its earlier
    prompt + a question) goes to the prefill server that holds its prefix, not round robin."""
    fleet.wait_healthy(prefills=2)

    def counts_after(expected_total: float) -> tuple[float, float]:
        deadline = time.monotonic() + 10.0
        while True:
            now = served(fleet.prefill_a, "prefill"), served(fleet.prefill_b, "prefill")
            if sum(now) >= expected_total or time.monotonic() > deadline:
                return now
            time.sleep(0.1)

    convo = "Keeper's log. " + " ".join(f"Day {i}: the lamp burned {i % 5 + 3} hours." for i in range(40))
    base = counts_after(0)
    assert fleet.generate(convo).error is None
    first = counts_after(sum(base) + 1)
    to_a = first[0] > base[0]
    for turn in range(3):
        convo += f" Question {turn}: what came next?"
        assert fleet.generate(convo).error is None
    last = counts_after(sum(first) + 3)
    assert (last[0] - first[0], last[1] - first[1]) == ((3, 0) if to_a else (0, 3)), (base, first, last)


def test_killing_a_prefill_server_fails_over_and_it_rejoins_when_restarted(fleet: Fleet, reference) -> None:
    fleet.wait_healthy(prefills=2)
    with ThreadPoolExecutor(len(LONG)) as pool:
        futures = [pool.submit(fleet.generate, p) for p in LONG]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # kill while prefill A holds requests
            if metric_value(fleet.prefill_a.metrics_url, "pd_queue_requests", model="prefill", queue="prefilling"):
                break
            time.sleep(0.02)
        killed_s = time.monotonic()
        fleet.prefill_a.kill()
        results = [f.result(timeout=300) for f in futures]
    for prompt, res in zip(LONG, results):
        assert res.final_seen or res.error, "every stream ends"
        if res.first_text_s is None or res.first_text_s > killed_s:   # no first token before the kill
            assert res.error is None and res.text == reference[prompt], res.error
    assert metric_value(fleet.router.metrics_url, "pd_router_retries_total") >= 1   # A held requests
    before_b = served(fleet.prefill_b, "prefill")
    later = [fleet.generate(p) for p in PROMPTS[:4]]
    assert all(r.error is None and r.text == reference[p] for p, r in zip(PROMPTS[:4], later))
    assert served(fleet.prefill_b, "prefill") == before_b + 4
    wait_pools_full((fleet.decode, "decode"), (fleet.prefill_b, "prefill"))

    restarted = ServeScript("prefill", fleet.tmp / "prefill_a2.log", env={**fleet.env, "ROLE": "prefill"},
                            ports=fleet.prefill_a.ports)
    fleet.prefill_a = restarted
    restarted.start(READY_S)
    fleet.wait_healthy(prefills=2)
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(fleet.generate, PROMPTS))
    assert all(r.error is None and r.text == reference[p] for p, r in zip(PROMPTS, again))
    assert served(restarted, "prefill") >= 1
    wait_pools_full((fleet.decode, "decode"), (fleet.prefill_b, "prefill"), (restarted, "prefill"))


def test_a_router_that_stops_answering_loses_its_lease_and_the_workers_free_its_pages(fleet: Fleet,
                                                                                    reference) -> None:
    """SIGSTOP of the router's stub: its gRPC connections stay open (no cancel reaches the children), only its
    lease stops being renewed. Within the registration TTL (10 s) the workers drop its requests and free every
    page; resumed, the router registers a new lease and serves again."""
    import os
    import signal

    fleet.wait_healthy(prefills=2)
    router_stub = next(pid for pid in fleet.router.stub_pids()
                       if b"pd_ensemble" in Path(f"/proc/{pid}/cmdline").read_bytes())
    params = {"max_tokens": "2000", "temperature": "0", "ignore_eos": "true"}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(grpc_generate, fleet.router.grpc_url, make_inputs(p, params), "pd_ensemble")
                   for p in PROMPTS[:3]]
        time.sleep(4.0)   # decoding
        assert not pools_full((fleet.decode, "decode"))
        os.kill(router_stub, signal.SIGSTOP)
        try:
            stopped_s = time.monotonic()
            wait_pools_full((fleet.decode, "decode"), (fleet.prefill_b, "prefill"), (fleet.prefill_a, "prefill"),
                            timeout_s=30.0)
            freed_after_s = time.monotonic() - stopped_s
        finally:
            os.kill(router_stub, signal.SIGCONT)
        results = [f.result(timeout=120) for f in futures]
    assert freed_after_s < 25.0, freed_after_s
    assert all(r.error for r in results), [r.error for r in results]   # the workers dropped them
    fleet.wait_healthy(prefills=2)
    again = fleet.generate(PROMPTS[0])
    assert again.error is None and again.text == reference[PROMPTS[0]]
