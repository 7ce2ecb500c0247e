"""Whole servers across network hosts (issue #21): ``scripts/serve.sh`` per host, as the README's "Across
servers" commands say (``scripts/fleet/serve_hosts.py``): registry on ``reg``, router on ``rt``, prefill on
``pf``, decode on ``dc``, KV over TCP on the veth links (``PD_KV_NETWORK_ONLY=1``), NIXL; the greedy test and
the decode host's link-down also with Mooncake (``TestMooncake``, first in the module: a fleet of its own, a
model repository copy with ``kv_backend: mooncake``, stopped before the NIXL fleet starts).

Invariants: greedy text through the router equals the colocated engine's; a seeded sampled request and its
logprobs equal the colocated engine's; the KV bytes the prefill reports crossed the prefill host's link; a
client cancel mid-stream frees the pages on both worker hosts; a long prompt sent again takes its prefix from
the prefill host's cache with the text unchanged; 10 streams at once with the prefill host's link throttled to
1 Gbit/s all give the colocated text and hold no page afterwards. Faults (docs/multihost.md, "Whole servers
across hosts"): the decode host's link down 5 s mid-transfer: every stream ends (FINAL, or an error), no page
leaks, no process restarted, the next request succeeds; the registry host's link down 10 s: requests keep
succeeding, the router's membership stays as it was, and after the link is back the fleet still serves; the
router's host cut off from the decode host alone mid-stream for 20 s: the stream ends with an error once
``blip_tolerance_s`` (15 s) passed, the decode host's pages come back once the path does, and the fleet serves
again with no restart; the router's host cut off from the prefill host right after the first token: the
request still ends with the colocated text.

``PD_FLEET_KV_BACKEND=mooncake`` runs the module's NIXL tests on a Mooncake fleet instead (by hand: CI runs
``TestMooncake`` only, for its time).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))   # live_client, live_prompts

import tritonclient.grpc as grpcclient  # noqa: E402
from fleet.serve_hosts import HostFleet  # noqa: E402
from live_client import StreamResult, grpc_generate, make_inputs, metric_value, streams_match_reference  # noqa: E402
from live_prompts import PROMPTS, colocated_greedy_texts  # noqa: E402
from perf.server import pd_model_repository  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.netns,
              pytest.mark.timeout(1500)]
READY_S = 240.0
GREEDY = {"max_tokens": "12", "temperature": "0"}
LONG = [f"Story {i}: " + "The river wound through the valley, past orchards and stone bridges. " * 40
        + "What flows through the valley?" for i in range(4)]
SEEDED = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True, "logprobs": 2}
POOL_S = 150.0   # a room whose peer vanished ends at the bootstrap timeout (120 s) at the latest


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory,
          fleet_kv_env: dict[str, str] | None) -> Iterator[HostFleet]:
    """The module's fleet: NIXL, or the backend ``PD_FLEET_KV_BACKEND`` names (``fleet_kv_env``)."""
    pytest.importorskip("pytriton")
    yield from started_fleet(tmp_path_factory.mktemp("hosts"), fleet_kv_env)


def started_fleet(tmp: Path, env: dict[str, str] | None = None) -> Iterator[HostFleet]:
    """A started ``HostFleet``, stopped (servers, then namespaces) however the test ends."""
    from fleet.netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    fleet = HostFleet(tmp, env)
    try:
        fleet.start(READY_S)
        yield fleet
    finally:
        fleet.stop()
    unclean = {name: stop for name, stop in fleet.stops.items() if stop[1]}
    assert not unclean, f"servers needed SIGKILL to stop (a stream left without FINAL?): {unclean}"


@pytest.fixture(scope="class")
def mooncake_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostFleet]:
    """The fleet with ``kv_backend`` mooncake, for the tests of ``TestMooncake`` (stopped at the end of the
    class, before the module's NIXL fleet starts: 2 cores, one fleet at a time)."""
    pytest.importorskip("pytriton")
    from kv_transfer import unavailable_reason

    if unavailable_reason("mooncake"):
        pytest.skip(str(unavailable_reason("mooncake")))
    tmp = tmp_path_factory.mktemp("mooncake-hosts")
    repo = pd_model_repository(tmp / "models", "mooncake")
    yield from started_fleet(tmp, {"MODEL_REPOSITORY": str(repo)})


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS + LONG, GREEDY)


def generate(hosts: HostFleet, prompt: str, params: dict[str, Any] | None = None, **kw: Any) -> StreamResult:
    return grpc_generate(hosts.servers["rt"].grpc_url, make_inputs(prompt, params or GREEDY),
                         model="pd_ensemble",
                         **kw)


def metric(hosts: HostFleet, name: str, role: str) -> float:
    host = {"prefill": "pf", "decode": "dc"}[role]
    try:
        return metric_value(hosts.servers[host].metrics_url, name, model=role)
    except KeyError:
        return 0.0


def pools_full(hosts: HostFleet) -> dict[str, tuple[float, float]]:
    """role → (free, total) pages, for the roles whose pool is not full (empty: every page is free)."""
    state = {r: (metric(hosts, "pd_kv_free_pages", r), metric(hosts, "pd_kv_total_pages", r))
             for r in ("prefill", "decode")}
    return {r: s for r, s in state.items() if s[0] != s[1] or s[1] == 0}


def wait_pools_full(hosts: HostFleet, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pools_full(hosts) and time.monotonic() < deadline:
        time.sleep(0.5)
    held = pools_full(hosts)
    assert not held, f"pages still held after {timeout_s:.0f} s: {held}; {worker_state(hosts)}"


def worker_state(hosts: HostFleet) -> str:
    """The workers' queue and KV gauges and counters (``pd_queue_requests``, ``pd_kv_*``), for a failure's
    message."""
    lines = []
    for host in ("pf", "dc"):
        text = requests.get(hosts.servers[host].metrics_url, timeout=5).text
        lines += [f"{host}: {line}" for line in text.splitlines()
                  if line.startswith(("pd_queue_requests", "pd_kv_")) and "_bucket" not in line]
    return "\n".join(lines)


def healthy(hosts: HostFleet, role: str) -> int:
    text = requests.get(hosts.servers["rt"].metrics_url, timeout=5).text
    return sum(1 for line in text.splitlines() if line.startswith("pd_router_healthy_instances{")
               and f'role="{role}"' in line and line.endswith(" 1"))


def stubs(hosts: HostFleet) -> dict[str, list[int]]:
    return {name: sorted(s.stub_pids()) for name, s in hosts.servers.items()}


def infer_outputs(url: str, prompt: str, params: dict[str, Any],
                  **flags: bool) -> tuple[list[dict[str, Any]], str | None]:
    """One streamed request asking for ``flags`` (default: logprobs and the cumulative logprob): (every
    response's outputs by name, the error or None)."""
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    outputs: list[dict[str, Any]] = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        asked = flags or {"return_logprobs": True, "return_cumulative_logprob": True}
        client.async_stream_infer("pd_ensemble", make_inputs(prompt, params, **asked),
                                  enable_empty_final_response=True)
        while True:
            res, err = events.get(timeout=120)
            if err is not None:
                return outputs, str(err)
            names = [o.name for o in res.get_response().outputs]
            if names:
                outputs.append({name: res.as_numpy(name) for name in names})
            if res.get_response().parameters["triton_final_response"].bool_param:
                return outputs, None
    finally:
        client.stop_stream()
        client.close()


def colocated_tokens(prompt: str, params: dict[str, Any]) -> tuple[str, list[tuple[int, float]], float]:
    """The colocated engine, in this process: (text, [(token id, logprob)], cumulative logprob)."""
    from engine import LLMEngine
    from serving.config import WorkerConfig
    from serving.parsing.prompt import prompt_token_ids
    from serving.parsing.request import parse_request

    engine = LLMEngine(WorkerConfig(num_pages=256).engine_config("colocated"))
    req = parse_request({"text_input": prompt.encode(), "sampling_parameters": json.dumps(params)})
    engine.add_request("0", prompt_token_ids(engine.tokenizer, req), req.params)
    text, tokens, cumulative = "", [], 0.0
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            tokens += [(t.token_id, t.logprob) for t in out.new_token_logprobs]
            cumulative = out.cumulative_logprob
    return text, tokens, cumulative


def check_greedy_text_crossed_the_link(hosts: HostFleet, reference: dict[str, str]) -> None:
    """Greedy text through the router equals the colocated engine's, and the KV bytes crossed the prefill
    host's link."""
    assert healthy(hosts, "prefill") == 1 and healthy(hosts, "decode") == 1
    kv_before = metric(hosts, "pd_kv_transfer_bytes_total", "prefill")
    link_before = hosts.host("pf").counters().tx_bytes
    streams_match_reference(lambda p: generate(hosts, p), PROMPTS, reference)
    kv_bytes = metric(hosts, "pd_kv_transfer_bytes_total", "prefill") - kv_before
    link_bytes = hosts.host("pf").counters().tx_bytes - link_before
    assert 0 < kv_bytes <= link_bytes, (kv_bytes, link_bytes)


def check_decode_link_down_5s_mid_transfer(hosts: HostFleet, reference: dict[str, str]) -> None:
    """The decode host's link down 5 s as soon as the first KV transfer of 4 concurrent long prompts
    completed: every stream ends (FINAL, or an error) once the link is back, no pages leak, no process
    restarts, the next request gives the colocated text."""
    before = stubs(hosts)
    kv_before = metric(hosts, "pd_kv_transfer_bytes_total", "prefill")
    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    results: dict[int, StreamResult] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(hosts, LONG[i], params)))
               for i in range(len(LONG))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while metric(hosts, "pd_kv_transfer_bytes_total", "prefill") == kv_before and time.monotonic() < deadline:
        time.sleep(0.05)
    hosts.host("dc").set_link(False)
    in_flight = len(LONG) - len(results)
    time.sleep(5.0)
    hosts.host("dc").set_link(True)
    down_end = time.monotonic()
    for t in threads:
        t.join(300)
    assert in_flight > 0, "every stream had ended before the link went down: the fault hit nothing"
    assert len(results) == len(LONG), "a stream never ended"
    for i, res in results.items():
        assert res.final_seen or res.error, f"stream {i} ended without FINAL or an error"
        if res.error is None:
            assert len(res.num_output_tokens) and res.num_output_tokens[-1] == params["max_tokens"], i
    ended_s = max(r.end_s or down_end for r in results.values()) - down_end
    print(f"link-down outcome: {[('ok' if r.error is None else r.error[:80]) for r in results.values()]}, "
          f"{in_flight} in flight at the link-down, the last ended {ended_s:.1f} s after the link came back")
    wait_pools_full(hosts, POOL_S)
    print(f"pools full {time.monotonic() - down_end:.1f} s after the link came back")
    assert stubs(hosts) == before, "a server or stub restarted"
    after = generate(hosts, PROMPTS[0])
    assert after.error is None and after.text == reference[PROMPTS[0]]


@pytest.mark.mooncake
class TestMooncake:
    """The first tests of the module (file order): the same fleet with Mooncake over TCP."""

    def test_greedy_text_across_hosts_equals_colocated(self, mooncake_hosts: HostFleet,
                                                        reference: dict[str, str]) -> None:
        check_greedy_text_crossed_the_link(mooncake_hosts, reference)

    def test_decode_hosts_link_down_5s_mid_transfer(self, mooncake_hosts: HostFleet,
                                                    reference: dict[str, str]) -> None:
        check_decode_link_down_5s_mid_transfer(mooncake_hosts, reference)


def test_greedy_text_across_hosts_equals_colocated(hosts: HostFleet, reference: dict[str, str]) -> None:
    check_greedy_text_crossed_the_link(hosts, reference)


def test_kv_bytes_crossed_the_prefill_hosts_link(hosts: HostFleet, reference: dict[str, str]) -> None:
    kv_before = metric(hosts, "pd_kv_transfer_bytes_total", "prefill")
    link_before = hosts.host("pf").counters().tx_bytes
    for prompt in LONG[:2]:
        result = generate(hosts, prompt)
        assert result.error is None and result.text == reference[prompt]
    kv_bytes = metric(hosts, "pd_kv_transfer_bytes_total", "prefill") - kv_before
    link_bytes = hosts.host("pf").counters().tx_bytes - link_before
    print(f"KV {kv_bytes} B, prefill link sent {link_bytes} B ({link_bytes / kv_bytes:.3f}x)")
    assert kv_bytes > 1_000_000, kv_bytes   # two ~700-token prompts' KV
    assert link_bytes >= kv_bytes, (link_bytes, kv_bytes)


def test_seeded_sampling_and_logprobs_across_hosts_equal_colocated(hosts: HostFleet) -> None:
    prompt = PROMPTS[1]
    outputs, error = infer_outputs(hosts.servers["rt"].grpc_url, prompt, SEEDED)
    assert error is None, error
    text, tokens, cumulative = colocated_tokens(prompt, SEEDED)
    served_text = "".join(o["text_output"].reshape(-1)[0].decode() for o in outputs)
    served = [entry for o in outputs for entry in (json.loads(o["logprobs"].reshape(-1)[0].decode()) or [])]
    assert served_text == text and text
    assert len(served) == len(tokens) == SEEDED["max_tokens"]
    for i, (entry, (token_id, logprob)) in enumerate(zip(served, tokens)):
        chosen = next(iter(entry))   # the sampled token comes first (the vLLM backend's layout)
        assert int(chosen) == token_id, f"token {i}"
        assert entry[chosen]["logprob"] == pytest.approx(logprob, abs=1e-4), f"token {i}"
    assert float(outputs[-1]["cumulative_logprob"].reshape(-1)[0]) == pytest.approx(cumulative, abs=1e-3)


def test_client_cancel_mid_stream_frees_pages_on_both_hosts(hosts: HostFleet) -> None:
    params = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    result = generate(hosts, LONG[2], params, cancel_after=2)
    assert result.error is None and not result.final_seen and len(result.texts) >= 2
    wait_pools_full(hosts, 30.0)


def test_prefix_cache_across_hosts(hosts: HostFleet, reference: dict[str, str]) -> None:
    """A long prompt sent twice: the second's prefill takes most of the prompt from the prefill host's prefix
    cache (``num_cached_tokens``, whole pages), decode on the other host still gets the prompt's KV, and the
    text is the colocated engine's both times. (Cache-aware pairing needs two prefill hosts: this fleet has
    one.)"""
    prompt = LONG[1]
    url = hosts.servers["rt"].grpc_url
    flags = {"return_num_cached_tokens": True, "return_num_input_tokens": True}
    seen: list[tuple[str, int, int]] = []
    for _ in range(2):
        outputs, error = infer_outputs(url, prompt, {"max_tokens": 12, "temperature": 0}, **flags)
        assert error is None, error
        text = "".join(o["text_output"].reshape(-1)[0].decode() for o in outputs if "text_output" in o)
        cached = max(int(o["num_cached_tokens"].reshape(-1)[0]) for o in outputs if "num_cached_tokens" in o)
        prompt_tokens = max(
            int(o["num_input_tokens"].reshape(-1)[0]) for o in outputs if "num_input_tokens" in o)
        seen.append((text, cached, prompt_tokens))
    print(f"prefix cache across hosts: (cached, prompt tokens) {[(c, n) for _, c, n in seen]}")
    assert [text for text, _, _ in seen] == [reference[prompt]] * 2
    _, cached, prompt_tokens = seen[1]
    assert cached % 16 == 0 and prompt_tokens // 2 <= cached < prompt_tokens, seen
    wait_pools_full(hosts, 30.0)


def test_prefill_link_throttled_to_1gbit_under_load(hosts: HostFleet) -> None:
    """The prefill host's link limited to 1 Gbit/s (``tc tbf`` both ways) while 4 fresh long prompts (their KV
    not cached on either host) and 6 short ones run at once: every stream ends with the colocated text, the KV
    bytes crossed the throttled link, no page is held afterwards and nothing restarted."""
    long = [f"Throttled {i}. " + LONG[i] for i in range(len(LONG))]
    prompts = long + PROMPTS[:6]
    expected = colocated_greedy_texts(prompts, GREEDY)
    before = stubs(hosts)
    kv_before = metric(hosts, "pd_kv_transfer_bytes_total", "prefill")
    link_before = hosts.host("pf").counters().tx_bytes
    results: dict[int, StreamResult] = {}
    hosts.host("pf").throttle(1000)
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(hosts, prompts[i])))
                   for i in range(len(prompts))]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        elapsed_s = time.monotonic() - start
    finally:
        hosts.host("pf").throttle(0)
    kv_bytes = metric(hosts, "pd_kv_transfer_bytes_total", "prefill") - kv_before
    link_bytes = hosts.host("pf").counters().tx_bytes - link_before
    print(f"throttled link under load: {len(prompts)} streams in {elapsed_s:.1f} s, KV "
          f"{kv_bytes / 2**20:.1f} MiB, prefill link sent {link_bytes / 2**20:.1f} MiB")
    assert len(results) == len(prompts), "a stream never ended"
    for i, prompt in enumerate(prompts):
        assert results[i].error is None and results[i].text == expected[prompt], (i, results[i].error)
    assert kv_bytes > 20_000_000 and link_bytes >= kv_bytes, (kv_bytes, link_bytes)
    wait_pools_full(hosts, 30.0)
    assert stubs(hosts) == before, "a server or stub restarted"


def test_decode_hosts_link_down_5s_mid_transfer(hosts: HostFleet, reference: dict[str, str]) -> None:
    check_decode_link_down_5s_mid_transfer(hosts, reference)


def test_registry_hosts_link_down_10s(hosts: HostFleet, reference: dict[str, str]) -> None:
    """Membership freezes (the router keeps its prefill and decode), requests succeed during and after."""
    before = stubs(hosts)
    hosts.host("reg").set_link(False)
    try:
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            result = generate(hosts, PROMPTS[0])
            assert result.error is None and result.text == reference[PROMPTS[0]], result.error
            assert healthy(hosts, "prefill") == 1 and healthy(hosts, "decode") == 1
    finally:
        hosts.host("reg").set_link(True)
    # past the registry's 10 s TTL: the workers' entries expired there and are announced again
    time.sleep(15.0)
    assert healthy(hosts, "prefill") == 1 and healthy(hosts, "decode") == 1
    streams_match_reference(lambda p: generate(hosts, p), PROMPTS[:3], reference)
    wait_pools_full(hosts, 30.0)
    assert stubs(hosts) == before, "a server or stub restarted"


def test_router_cut_off_from_the_decode_host_mid_stream(hosts: HostFleet, reference: dict[str, str]) -> None:
    """The router's host and the decode host partitioned from each other for 20 s while a stream decodes (both
    keep their other links). The decode host stops answering the router's rendezvous polls too, so the router
    gives the stream up once that silence outlasts ``blip_tolerance_s`` (15 s; a shorter cut is waited out:
    tests/fleet/test_blips_live.py), not after the 300 s idle timeout: with no other decode host to migrate
    to, the client gets one error naming the decode instance. The router cancels that stream on the decode's
    own endpoint (``ChildStreams.forget``; through tritonserver it would leave it to end by itself: a late
    cancel aborted tritonserver 2.51): once the path is back the decode host ends the request and its pages
    come back, the router lists it healthy again, new requests succeed, and nothing restarted."""
    before = stubs(hosts)
    params = {"max_tokens": 600, "temperature": 0, "ignore_eos": True}
    done: dict[str, StreamResult] = {}
    thread = threading.Thread(target=lambda: done.__setitem__("r", generate(hosts, LONG[3], params)))
    thread.start()
    deadline = time.monotonic() + 120
    while not metric_value(hosts.servers["dc"].metrics_url, "pd_queue_requests", model="decode",
                           queue="running"):
        assert time.monotonic() < deadline and thread.is_alive(), \
            "the request never reached decode's running queue"
        time.sleep(0.1)
    time.sleep(1.0)   # a few tokens streamed
    with hosts.fleet.partitioned("rt", "dc", at_least_s=20.0) as cut_s:
        thread.join(60)
        ended_s = time.monotonic() - cut_s
    assert not thread.is_alive(), "the stream did not end within 60 s of the partition"
    result = done["r"]
    print(f"router cut off from decode: the stream ended {ended_s:.1f} s after the cut: {result.error}")
    assert result.error is not None and "decode" in result.error and result.texts, result.error
    # waited as a blip (its silence began at its last token, a moment before the cut), not given up at 3 s
    assert 12.0 <= ended_s < 30.0, ended_s
    wait_pools_full(hosts, POOL_S)
    deadline = time.monotonic() + 30
    while healthy(hosts, "decode") != 1:
        assert time.monotonic() < deadline, "the router did not list the decode host healthy again"
        time.sleep(0.5)
    streams_match_reference(lambda p: generate(hosts, p), PROMPTS[:2], reference)
    assert stubs(hosts) == before, "a server or stub restarted"


def test_router_cut_off_from_the_prefill_host_after_the_first_token(hosts: HostFleet,
                                                                   reference: dict[str, str]) -> None:
    """The router's host and the prefill host partitioned from each other as soon as the first token reached
    the client, the prefill link throttled to 100 Mbit/s so that the prompt's last KV chunk is still crossing
    to the decode host (that path stays up): the prefill's own FINAL, sent once its transfer settled, cannot
    reach the router, while decode decodes and streams to its end. The request ends with the colocated text
    and its finish reason, not with the prefill's unreachability (found by an operator's trial, 2026-12-04:
    the last tokens were lost to that error); pages come back on both hosts once the path is back; nothing
    restarted."""
    before = stubs(hosts)
    prompt = LONG[1]
    cut, released = threading.Event(), threading.Event()

    def partition() -> None:
        if cut.wait(120):
            with hosts.fleet.partitioned("rt", "pf", at_least_s=8.0):
                released.wait(60)

    thread = threading.Thread(target=partition)
    thread.start()
    hosts.host("pf").throttle(100)
    try:
        result = grpc_generate(hosts.servers["rt"].grpc_url, make_inputs(prompt, GREEDY), model="pd_ensemble",
                               on_first_text=cut.set)
    finally:
        released.set()
        cut.set()
        thread.join(90)
        hosts.host("pf").throttle(0)
    print(f"router cut off from prefill after the first token: error {result.error}, "
          f"{len(result.texts)} responses, finish {result.finish_reasons}")
    assert result.error is None and result.final_seen, result.error
    assert result.text == reference[prompt]
    wait_pools_full(hosts, 60.0)
    streams_match_reference(lambda p: generate(hosts, p), PROMPTS[:2], reference)
    assert stubs(hosts) == before, "a server or stub restarted"


def test_prefill_host_cut_off_from_the_registry(hosts: HostFleet, reference: dict[str, str]) -> None:
    """The prefill host alone partitioned from the registry host for 15 s (past the registry's 10 s TTL,
    within TTL + the router's 10 s grace for members the registry stops listing), its path to the router and
    decode intact: every request during the partition ends with FINAL or a clear error
    (none hangs), and once the path is back the prefill announces itself again, the router lists it, requests
    give the colocated text, no page is held and nothing restarted."""
    before = stubs(hosts)
    during: list[StreamResult] = []
    with hosts.fleet.partitioned("pf", "reg") as cut_s:
        while time.monotonic() < cut_s + 15.0:
            started = time.monotonic()
            during.append(generate(hosts, PROMPTS[0]))
            assert time.monotonic() - started < 60.0, "a request during the partition took over 60 s"
            time.sleep(0.5)
    assert all(r.final_seen or r.error for r in during), "a stream ended without FINAL or an error"
    print(f"prefill cut off from the registry: {sum(r.error is None for r in during)} of {len(during)} "
          "requests succeeded during the partition; errors: "
          f"{sorted({r.error[:100] for r in during if r.error})}")
    assert all(r.error is not None or r.text == reference[PROMPTS[0]] for r in during)
    deadline = time.monotonic() + 30
    while healthy(hosts, "prefill") != 1 or healthy(hosts, "decode") != 1:
        assert time.monotonic() < deadline, "the router did not see the whole fleet again within 30 s"
        time.sleep(0.5)
    streams_match_reference(lambda p: generate(hosts, p), PROMPTS[:2], reference)
    wait_pools_full(hosts, 30.0)
    assert stubs(hosts) == before, "a server or stub restarted"
