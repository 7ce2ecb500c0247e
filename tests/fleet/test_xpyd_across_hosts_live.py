"""2 prefill hosts + 2 decode hosts behind a router host (issue #21 item 3): ``scripts/serve.sh`` per host as
the README's "Across servers" commands say (``scripts/fleet/serve_hosts.py``, ``XPYD_2P2D``), NIXL over TCP on
the veth links (``PD_KV_NETWORK_ONLY=1``); ``PD_FLEET_KV_BACKEND=mooncake`` runs the module on a Mooncake
fleet instead (by hand: CI runs NIXL).

Invariants: the router lists both prefill and both decode hosts; greedy text through the router equals the
colocated engine's for prompts sent at once, and every worker host served some of them (each prefill host's
link carried KV); cache-aware pairing across hosts: a long prompt sent again goes to the prefill host that
holds its prefix (only that host's prefix-cache hits grow) with the text unchanged; a decode host cut off from
the router mid-stream for longer than ``blip_tolerance_s`` loses the stream to the other decode host, which
resumes it (migration) with the colocated text, and
the cut-off host comes back by itself; no page is held afterwards on any host and nothing restarted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))   # live_client, live_prompts

from fleet.serve_hosts import XPYD_2P2D, HostFleet  # noqa: E402
from live_client import StreamResult, grpc_generate, make_inputs, metric_value  # noqa: E402
from live_prompts import PROMPTS, colocated_greedy_texts  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.netns,
              pytest.mark.timeout(1200)]
READY_S = 240.0
GREEDY = {"max_tokens": "12", "temperature": "0"}
WORKERS = [h for h, role in XPYD_2P2D.items() if role != "router"]
PREFILLS = [h for h in WORKERS if XPYD_2P2D[h] == "prefill"]
#: long prompts with prefixes of their own (the prefix cache of either prefill host holds none of them at
#: first)
LONG = [f"Report {i}. " + "The river wound through the valley, past orchards and stone bridges. " * 30
        + "What flows through the valley?" for i in range(4)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory,
          fleet_kv_env: dict[str, str] | None) -> Iterator[HostFleet]:
    pytest.importorskip("pytriton")
    from fleet.netns import unavailable_reason as netns_unavailable

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    fleet = HostFleet(tmp_path_factory.mktemp("xpyd_hosts"), fleet_kv_env, roles=XPYD_2P2D)
    try:
        fleet.start(READY_S)
        deadline = time.monotonic() + 60
        while (healthy(fleet, "prefill"), healthy(fleet, "decode")) != (2, 2):
            assert time.monotonic() < deadline, "the router did not list 2 prefill and 2 decode hosts"
            time.sleep(0.5)
        yield fleet
    finally:
        fleet.stop()
    unclean = {name: stop for name, stop in fleet.stops.items() if stop[1]}
    assert not unclean, f"servers needed SIGKILL to stop (a stream left without FINAL?): {unclean}"


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS + LONG, GREEDY)


def generate(hosts: HostFleet, prompt: str, params: dict[str, Any] | None = None) -> StreamResult:
    return grpc_generate(hosts.servers["rt"].grpc_url, make_inputs(prompt, params or GREEDY),
                         model="pd_ensemble")


def healthy(hosts: HostFleet, role: str) -> int:
    text = __import__("requests").get(hosts.servers["rt"].metrics_url, timeout=5).text
    return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
               and f'role="{role}"' in line and line.endswith(" 1"))


def worker_metric(hosts: HostFleet, host: str, name: str) -> float:
    try:
        return metric_value(hosts.servers[host].metrics_url, name, model=XPYD_2P2D[host])
    except KeyError:
        return 0.0


def served(hosts: HostFleet) -> dict[str, float]:
    """Host → requests its engine finished (``pd_requests_total`` of its model, every outcome)."""
    out = {}
    for host in WORKERS:
        text = __import__("requests").get(hosts.servers[host].metrics_url, timeout=5).text
        out[host] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("pd_requests_total{"))
    return out


def wait_pools_full(hosts: HostFleet, timeout_s: float) -> None:
    def held() -> dict[str, tuple[float, float]]:
        state = {h: (worker_metric(hosts, h, "pd_kv_free_pages"),
                     worker_metric(hosts, h, "pd_kv_total_pages"))
                 for h in WORKERS}
        return {h: s for h, s in state.items() if s[0] != s[1] or s[1] == 0}

    deadline = time.monotonic() + timeout_s
    while held() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not held(), f"pages still held after {timeout_s:.0f} s: {held()}"


def test_every_pair_across_hosts_serves_the_colocated_text(hosts: HostFleet,
                                                           reference: dict[str, str]) -> None:
    prompts = PROMPTS + LONG
    served_before = served(hosts)
    link_before = {h: hosts.host(h).counters().tx_bytes for h in PREFILLS}
    results: dict[int, StreamResult] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(hosts, prompts[i])))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == len(prompts), "a stream never ended"
    for i, prompt in enumerate(prompts):
        assert results[i].error is None and results[i].text == reference[prompt], (i, results[i].error)
    by_host = {h: served(hosts)[h] - served_before[h] for h in WORKERS}
    link = {h: hosts.host(h).counters().tx_bytes - link_before[h] for h in PREFILLS}
    print(f"2P2D across hosts: requests by host {by_host}, prefill links sent {link} B")
    assert all(n > 0 for n in by_host.values()), by_host
    assert all(n > 1_000_000 for n in link.values()), link   # each prefill host sent some prompt's KV
    wait_pools_full(hosts, 30.0)


def test_cache_aware_pairing_sends_a_repeated_prompt_to_the_prefill_host_holding_it(
        hosts: HostFleet, reference: dict[str, str]) -> None:
    prompt = LONG[0]   # prefilled once by the test above, on one of the two hosts
    hits_before = {h: worker_metric(hosts, h, "pd_prefix_cache_hits_tokens_total") for h in PREFILLS}
    for _ in range(3):
        result = generate(hosts, prompt)
        assert result.error is None and result.text == reference[prompt], result.error
    gained = {h: worker_metric(hosts, h,
                               "pd_prefix_cache_hits_tokens_total") - hits_before[h] for h in PREFILLS}
    print(f"cache-aware pairing across hosts: prefix-cache hit tokens gained by host {gained}")
    holder = [h for h, g in gained.items() if g > 0]
    assert len(holder) == 1, gained   # every repeat went to the host that held the prefix
    assert gained[holder[0]] >= 3 * 16 * 10, gained   # three hits of most of a ~500-token prompt
    wait_pools_full(hosts, 30.0)


def migrations(hosts: HostFleet) -> float:
    """The router's ``pd_router_migrations_total`` (0 before its first migration: the counter appears
    then)."""
    try:
        return metric_value(hosts.servers["rt"].metrics_url, "pd_router_migrations_total")
    except KeyError:
        return 0.0


def test_a_decode_host_cut_off_mid_stream_migrates_to_the_other_decode_host(hosts: HostFleet) -> None:
    """The router's host and the decode host serving a stream partitioned from each other for 20 s, a few
    tokens in (every other path up). The router hears nothing from that decode for longer than
    ``blip_tolerance_s`` (15 s; a shorter cut is waited out: tests/fleet/test_blips_live.py) and migrates the
    stream to the other decode host: it resumes the request with the tokens already sent, so the client gets
    every token once, no error, and the colocated greedy text. Once the path is back the cut-off host ends its
    copy of the request (the router's CANCEL of that stream, on its own endpoint, arrives then), its pages
    come back, the router lists both decode hosts again, and no server or stub restarted."""
    decodes = [h for h in WORKERS if XPYD_2P2D[h] == "decode"]
    prompt = LONG[2]
    params = {"max_tokens": 160, "temperature": 0, "ignore_eos": True}
    expected = colocated_greedy_texts([prompt], {k: str(v).lower() if isinstance(v, bool) else str(v)
                                                 for k, v in params.items()})[prompt]
    before = {name: sorted(s.stub_pids()) for name, s in hosts.servers.items()}
    migrations_before = migrations(hosts)
    done: dict[str, StreamResult] = {}
    thread = threading.Thread(target=lambda: done.__setitem__("r", generate(hosts, prompt, params)))
    thread.start()
    victim = ""
    deadline = time.monotonic() + 120
    while not victim:
        assert time.monotonic() < deadline and thread.is_alive(), "the request never reached a decode host"
        victim = next((h for h in decodes if metric_value(hosts.servers[h].metrics_url, "pd_queue_requests",
                                                          model="decode", queue="running")), "")
        time.sleep(0.1)
    time.sleep(1.0)   # a few tokens streamed: the stream moves mid-way, not at its first token
    with hosts.fleet.partitioned("rt", victim, at_least_s=20.0) as cut_s:
        thread.join(90)
        ended_s = time.monotonic() - cut_s
    assert not thread.is_alive(), "the stream did not end within 90 s of the cut"
    result = done["r"]
    migrated = migrations(hosts) - migrations_before
    print(f"2P2D across hosts: decode host {victim} cut off from the router; the stream ended {ended_s:.1f} "
          f"s after the cut, {migrated:.0f} migration(s), error {result.error}")
    assert result.error is None and result.final_seen, result.error
    assert result.text == expected
    assert migrated >= 1
    wait_pools_full(hosts, 150.0)   # the cut-off host's copy ends once the path is back
    deadline = time.monotonic() + 30
    while healthy(hosts, "decode") != 2:
        assert time.monotonic() < deadline, "the router did not list both decode hosts again"
        time.sleep(0.5)
    assert {name: sorted(s.stub_pids()) for name, s in hosts.servers.items()} == before, "something restarted"
