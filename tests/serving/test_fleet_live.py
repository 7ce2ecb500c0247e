"""PD across tritonservers: a membership registry (``python -m bootstrap.membership``, its own process), a
router-only server (``pd_ensemble``), prefill-only and decode-only servers on other ports, which announce
themselves at the registry; the router finds them there and asks each one's own rendezvous for its load.

Invariants: greedy text through the router equals the colocated engine's; with a second prefill server (2P1D,
both serving a model named ``prefill``) both receive requests, and a conversation's next turns go back to the
prefill server holding its prefix (cache-aware pairing); ``kill -9`` of one prefill server while requests
are in flight: every request that had no first token yet completes on the other one, and every later one goes
there; started again, it rejoins and serves; ``kill -9`` of one of two decode servers mid-stream: its requests
migrate to the other one and end with the colocated text; every surviving pool is back at its size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from live_client import (
    StreamResult,
    finished_requests,
    grpc_generate,
    make_inputs,
    metric_value,
    streams_match_reference,
)
from live_prompts import PROMPTS as BASE_PROMPTS
from live_prompts import colocated_greedy_texts
from perf.server import RegistryProcess, ServeScript

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
        self.registry = RegistryProcess(tmp / "registry.log")
        env = {"PD_REGISTRY_URL": self.registry.url}
        self.router = ServeScript("pd_ensemble", tmp / "router.log", env={**env, "ROLE": "router"})
        self.decode = ServeScript("decode", tmp / "decode.log", env={**env, "ROLE": "decode"})
        self.decode_b = ServeScript("decode", tmp / "decode_b.log", env={**env, "ROLE": "decode"})
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
        raise AssertionError(
            f"router sees {self.healthy('prefill')} prefill / {self.healthy('decode')} decode")

    def generate(self, prompt: str) -> StreamResult:
        return grpc_generate(self.router.grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble")

    def start_registry(self) -> None:
        self.registry.start()

    def stop_registry(self, kill: bool = False) -> None:
        self.registry.stop(kill)

    def stop(self) -> None:
        for server in (self.prefill_b, self.prefill_a, self.decode_b, self.decode, self.router):
            server.stop(40.0)
        self.stop_registry()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    pytest.importorskip("pytriton")
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        f.start_registry()
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
    return finished_requests(server.metrics_url, model)


def pools_full(*servers: tuple[ServeScript, str]) -> bool:
    return all(metric_value(s.metrics_url, "pd_kv_free_pages", model=m)
               == metric_value(s.metrics_url, "pd_kv_total_pages", model=m) for s, m in servers)


def wait_pools_full(*servers: tuple[ServeScript, str], timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pools_full(*servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pools_full(*servers), [(s.log_path.name, m, pool_state(s, m)) for s, m in servers]


def pool_state(server: ServeScript, model: str) -> dict[str, float]:
    """Free and total pages, and the worker's queues, for a failure message."""
    import requests

    state = {name: metric_value(server.metrics_url, name, model=model)
             for name in ("pd_kv_free_pages", "pd_kv_total_pages")}
    for line in requests.get(server.metrics_url, timeout=5).text.splitlines():
        if line.startswith("pd_queue_requests{") and f'model="{model}"' in line:
            state[line.split("queue=")[1].split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return state


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


def prefill_selections(fleet: Fleet) -> dict[str, float]:
    """The router's ``pd_router_selections_total{role="prefill"}`` per prefill instance (counted when it pairs
    a request, so a request the client saw end is always in it)."""
    import requests

    text = requests.get(fleet.router.metrics_url, timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pd_router_selections_total{") and 'role="prefill"' in line:
            out[line.split('target="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_cache_aware_pairing_sends_a_conversation_back_to_its_prefill(fleet: Fleet) -> None:
    """The default policy (cache_aware) on an idle 2P1D fleet: each next turn of a conversation (its earlier
    prompt + a question), sent the moment the last one ended, goes to the prefill server that holds its
    prefix, not round robin, also while the servers' last load reports still count the turn before."""
    fleet.wait_healthy(prefills=2)
    wait_pools_full((fleet.prefill_a, "prefill"), (fleet.prefill_b, "prefill"), (fleet.decode, "decode"))

    def send(prompt: str) -> str:
        """The prefill instance the router paired ``prompt`` with."""
        before = prefill_selections(fleet)
        assert fleet.generate(prompt).error is None
        after = prefill_selections(fleet)
        chosen = [target for target, n in after.items() if n != before.get(target, 0.0)]
        assert len(chosen) == 1 and after[chosen[0]] == before.get(chosen[0], 0.0) + 1, (before, after)
        return chosen[0]

    convo = "Keeper's log. " + " ".join(f"Day {i}: the lamp burned {i % 5 + 3} hours." for i in range(40))
    turns = [send(convo)]
    for turn in range(3):
        convo += f" Question {turn}: what came next?"
        turns.append(send(convo))
    assert turns == [turns[0]] * 4, turns


def test_killing_a_prefill_server_fails_over_and_it_rejoins_when_restarted(fleet: Fleet, reference) -> None:
    fleet.wait_healthy(prefills=2)
    with ThreadPoolExecutor(len(LONG)) as pool:
        futures = [pool.submit(fleet.generate, p) for p in LONG]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # kill while prefill A holds requests
            if metric_value(fleet.prefill_a.metrics_url, "pd_queue_requests", model="prefill",
                            queue="prefilling"):
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


#: the decode-kill test's requests: long enough to be mid-stream when decode B dies (2 s after B's first
#: running request, at ~0.2-0.3 s per token of six streams on 2 cores: ~10 tokens in); their in-process
#: reference is the module's slowest setup (200 tokens took 55 s), so no longer than that needs
DECODE_KILL = {"max_tokens": "120", "temperature": "0", "ignore_eos": "true"}


@pytest.fixture(scope="module")
def long_reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS[:6], DECODE_KILL)


def test_killing_a_decode_server_migrates_its_streams_and_new_ones_succeed(fleet: Fleet, reference,
                                                                           long_reference) -> None:
    """2P2D: ``kill -9`` of one decode server while it streams tokens. Its requests migrate: the router
    resumes each on the surviving decode server with the tokens already sent (``migration_limit``), so every
    stream ends without an error and with the colocated greedy text, each token once; new requests all succeed
    on the surviving decode server right away, and every surviving pool comes back full."""
    fleet.decode_b.start(READY_S)
    fleet.wait_healthy(prefills=2, decodes=2)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(grpc_generate, fleet.router.grpc_url, make_inputs(p, DECODE_KILL),
                               "pd_ensemble")
                   for p in PROMPTS[:6]]
        deadline = time.monotonic() + 30   # the pairing may keep B idle: the invariants below hold either way
        b_streaming = False
        while time.monotonic() < deadline and not b_streaming:   # kill while decode B streams tokens
            b_streaming = bool(metric_value(fleet.decode_b.metrics_url, "pd_queue_requests", model="decode",
                                            queue="running"))
            time.sleep(0.05)
        if b_streaming:
            time.sleep(2.0)   # a few tokens in: its streams migrate mid-stream, not at their first token
        fleet.decode_b.kill()
        results = [f.result(timeout=600) for f in futures]
    assert all(r.final_seen for r in results), [r.error for r in results]
    for prompt, res in zip(PROMPTS[:6], results):
        assert res.error is None and res.text == long_reference[prompt], (prompt, res.error)
    if b_streaming:   # decode B held requests past their first token when it died: they moved
        assert metric_value(fleet.router.metrics_url, "pd_router_migrations_total") >= 1
    started = time.monotonic()
    later = [fleet.generate(p) for p in PROMPTS[:4]]
    assert all(r.error is None and r.text == reference[p] for p, r in zip(PROMPTS[:4], later)), \
        [r.error for r in later]
    assert time.monotonic() - started < 120.0
    wait_pools_full((fleet.decode, "decode"), (fleet.prefill_a, "prefill"), (fleet.prefill_b, "prefill"))


def test_the_registry_killed_idle_and_mid_load_freezes_membership_only(fleet: Fleet, reference) -> None:
    """``kill -9`` of the registry, idle and then while requests run: every request succeeds with the
    colocated text (the router keeps its last view and asks each instance's own rendezvous), with no wait;
    restarted empty, the workers announce themselves again and the router still sees the whole fleet."""
    fleet.wait_healthy(prefills=2)
    fleet.stop_registry(kill=True)
    started = time.monotonic()
    idle = [fleet.generate(p) for p in PROMPTS[:2]]
    assert all(r.error is None and r.text == reference[p] for p, r in zip(PROMPTS[:2], idle))
    assert time.monotonic() - started < 30.0
    fleet.start_registry()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fleet.generate, p) for p in PROMPTS]
        time.sleep(0.5)
        fleet.stop_registry(kill=True)
        results = [f.result(timeout=300) for f in futures]
    assert all(r.error is None and r.text == reference[p] for p, r in zip(PROMPTS, results)), \
        [r.error for r in results]
    fleet.start_registry()
    time.sleep(3.0)   # the workers' next renewal registers them again
    fleet.wait_healthy(prefills=2)
    assert fleet.generate(PROMPTS[0]).text == reference[PROMPTS[0]]


def test_a_killed_router_server_frees_every_page_and_a_restarted_one_serves(fleet: Fleet, reference) -> None:
    """``kill -9`` of the router's server while it streams: its gRPC connections drop, Triton cancels its
    child requests on the worker servers, and the workers drop the rooms and free every page within seconds
    (no lease needed); the router started again on the same ports finds the fleet in the registry and
    serves."""
    fleet.wait_healthy(prefills=2)
    params = {"max_tokens": "2000", "temperature": "0", "ignore_eos": "true"}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(grpc_generate, fleet.router.grpc_url, make_inputs(p, params), "pd_ensemble")
                   for p in PROMPTS[:3]]
        time.sleep(4.0)   # decoding
        assert not pools_full((fleet.decode, "decode"))
        killed_s = time.monotonic()
        fleet.router.kill()
        wait_pools_full((fleet.decode, "decode"), (fleet.prefill_b, "prefill"), (fleet.prefill_a, "prefill"),
                        timeout_s=30.0)
        freed_after_s = time.monotonic() - killed_s
        results = [f.result(timeout=120) for f in futures]
    assert freed_after_s < 10.0, freed_after_s
    assert all(r.error for r in results), [r.error for r in results]   # their router is gone
    restarted = ServeScript("pd_ensemble", fleet.tmp / "router2.log", env={**fleet.env, "ROLE": "router"},
                            ports=fleet.router.ports)
    fleet.router = restarted
    restarted.start(READY_S)
    fleet.wait_healthy(prefills=2)
    again = fleet.generate(PROMPTS[0])
    assert again.error is None and again.text == reference[PROMPTS[0]]
