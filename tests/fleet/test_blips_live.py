"""Blips lose nothing, deaths fail over fast (issue #50 item 3): whole servers across network hosts
(``scripts/fleet/serve_hosts.py``: registry, router, two prefill hosts, one decode host; KV over TCP on the
veth links), the tiny model, prompts long enough that their KV is still crossing the link (prefill servers
prefill 16 tokens a step).

Invariants: the link of the prefill host holding rooms goes down for 5 s, then for 10 s, mid-transfer, and
then the decode host's, the router host's and the registry host's for 10 s each: every request completes with
all its tokens (TCP's retransmissions carry the stalled connections through; the router and the decode side
wait for a silent instance up to ``blip_tolerance_s``, 15 s). A prefill server killed
(``kill -9``) mid-transfer is known dead at once (its connections reset, its rendezvous refuses): its requests
go on elsewhere (the other prefill, or decode alone) within seconds, far below ``blip_tolerance_s``. Each case
prints its times (docs/healing.md, "Blips").
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))   # live_client

from fleet.serve_hosts import HostFleet  # noqa: E402
from live_client import StreamResult, grpc_generate, make_inputs, metric_value  # noqa: E402
from perf.server import Deployment, build_model_repository  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.netns,
              pytest.mark.timeout(1500)]
READY_S = 300.0
ROLES = {"rt": "router", "pf": "prefill", "pf2": "prefill", "dc": "decode"}
PARAMS = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
#: ~2800 tokens each, prefilled 16 a step: a burst keeps a prefill host's rooms (and their KV) in flight for
#: seconds
PROMPT = "The river wound through the valley, past orchards and stone bridges. " * 200
BLIP_TOLERANCE_S = 15.0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostFleet]:
    pytest.importorskip("pytriton")
    from fleet.netns import unavailable_reason
    from perf.tiny_model import build_tiny_llama

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("blips")
    tiny = str(build_tiny_llama(tmp / "tiny"))
    decode = {"model": tiny, "num_pages": "2048"}
    prefill = {**decode, "chunk_size": "16", "max_num_batched_tokens": "16"}
    repo = build_model_repository(Deployment("pd", "pd_ensemble", ("pd_ensemble", "prefill", "decode"),
                                             overrides={"prefill": prefill, "decode": decode,
                                                        "pd_ensemble": {"tokenizer": tiny}}), tmp / "models")
    fleet = HostFleet(tmp, {"MODEL_REPOSITORY": str(repo)}, roles=ROLES)
    try:
        fleet.start(READY_S)
        deadline = time.monotonic() + 60
        while (healthy(fleet, "prefill"), healthy(fleet, "decode")) != (2, 1):
            assert time.monotonic() < deadline, "the router did not list 2 prefill hosts and 1 decode host"
            time.sleep(0.5)
        yield fleet
    finally:
        fleet.stop()


def healthy(hosts: HostFleet, role: str) -> int:
    text = __import__("requests").get(hosts.servers["rt"].metrics_url, timeout=5).text
    return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
               and f'role="{role}"' in line and line.endswith(" 1"))


def pages_in_use(hosts: HostFleet, host: str) -> float:
    url = hosts.servers[host].metrics_url
    return metric_value(url, "pd_kv_total_pages", model="prefill") - metric_value(url, "pd_kv_free_pages",
                                                                                 model="prefill")


def burst(hosts: HostFleet, n: int, tag: str) -> list[Future[StreamResult]]:
    pool = ThreadPoolExecutor(n)
    url = hosts.servers["rt"].grpc_url
    futures = [pool.submit(grpc_generate, url, make_inputs(f"{tag} {i}. {PROMPT}", PARAMS), "pd_ensemble")
               for i in range(n)]
    pool.shutdown(wait=False)
    return futures


def busy_prefill(hosts: HostFleet, candidates: tuple[str, ...] = ("pf", "pf2")) -> str:
    """The first prefill host seen holding rooms (pages in use)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for host in candidates:
            if pages_in_use(hosts, host) > 0:
                return host
        time.sleep(0.02)
    raise AssertionError("no prefill host got a room")


def complete(futures: list[Future[StreamResult]]) -> tuple[list[StreamResult], float]:
    """The results, each checked (FINAL, no error, every token), and when the last one ended."""
    results = [f.result(timeout=300) for f in futures]
    for res in results:
        assert res.error is None and res.final_seen, res.error
        assert res.num_output_tokens[-1] == PARAMS["max_tokens"]
    return results, max(r.end_s for r in results if r.end_s)


def test_a_burst_without_a_fault_completes(hosts: HostFleet) -> None:
    """The reference for the times below: the same burst, nothing cut."""
    began = time.monotonic()
    _, last_s = complete(burst(hosts, 8, "Calm"))
    print(f"no fault: 8/8 completed in {last_s - began:.1f} s")


@pytest.mark.parametrize("down_s", [5.0, 10.0])
def test_a_prefill_hosts_link_down_mid_transfer_loses_no_request(hosts: HostFleet, down_s: float) -> None:
    futures = burst(hosts, 8, f"Blip {down_s:g}")
    host = busy_prefill(hosts)
    hosts.host(host).set_link(False)
    down_at = time.monotonic()
    try:
        time.sleep(down_s)
    finally:
        hosts.host(host).set_link(True)
    up_at = time.monotonic()
    held = pages_in_use(hosts, host)
    results, last_s = complete(futures)
    print(f"{host} link down {down_s:g} s ({held:.0f} pages still held at link-up): 8/8 completed, the last "
          f"{last_s - up_at:.1f} s after the link came back ({last_s - down_at:.1f} s after it went down)")


@pytest.mark.parametrize("host", ["dc", "rt", "reg"])
def test_the_decode_router_or_registry_hosts_link_down_10s_mid_transfer_loses_no_request(hosts: HostFleet,
                                                                                       host: str) -> None:
    """The same 10 s blip on the decode host (KV writes and the router's streams to it stall), on the
    router's host (every child stream and rendezvous poll of the router stalls; the clients reach it on its
    own host) or on the registry's (no member can renew or read its entry: the fleet's view must outlive the
    silence, and the requests after it are served)."""
    futures = burst(hosts, 8, f"Blip {host}")
    busy_prefill(hosts)
    hosts.host(host).set_link(False)
    down_at = time.monotonic()
    try:
        time.sleep(10.0)
    finally:
        hosts.host(host).set_link(True)
    up_at = time.monotonic()
    _, last_s = complete(futures)
    print(f"{host} link down 10 s: 8/8 completed, the last {last_s - up_at:.1f} s after the link came back "
          f"({last_s - down_at:.1f} s after it went down)")
    complete(burst(hosts, 2, f"After {host}"))   # served once the link is back


def test_a_killed_prefill_is_known_dead_and_its_requests_go_on_within_seconds(hosts: HostFleet) -> None:
    futures = burst(hosts, 8, "Kill")
    host = busy_prefill(hosts)
    killed_at = time.monotonic()
    hosts.servers[host].kill()
    results, last_s = complete(futures)
    print(f"{host} killed mid-transfer: 8/8 completed, the last {last_s - killed_at:.1f} s after the kill")
    assert last_s - killed_at < BLIP_TOLERANCE_S, "a death was waited for as a blip"
