"""PD with DP attention (issue #47 item 2, docs/parallelism.md): a tiny random DeepSeek-V3 (fp32) 1P1D through
the router's orchestrator and the in-process KV backend, prefill and decode each with 2 DP ranks or one, in
the three pairings DP -> DP, DP -> one rank, one rank -> DP; and DP -> DP over NIXL (two agents in this
process, UCX over host memory: the decode's region is the ranks' shared memfd) and over Mooncake (TCP).

Invariants: 4 concurrent streams equal the colocated single-rank engine's greedy text; the router chooses a
rank on each DP side only, and that side ran each request on the rank chosen, spread over both ranks (its
per-rank counters); the registered KV region of a DP instance is every rank's pool
(2 x ``num_pages`` pages), so a request's KV lands in the pool of the rank that serves it; every page is back
after the streams end, and the instance's status at its rendezvous lists each rank's free pages and queued
prompt tokens. Balance (issue #47 item 3): 32 concurrent requests of 1-16 prompt tokens through the router to
DP prefill (N=2) -> DP decode (N=2): on each side the ranks the router chose served requests and tokens
(prompt tokens on the prefill, generated tokens on the decode) within 1.5x of each other, and every stream
equals the colocated single-rank engine's greedy text.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_moe_pd_workers import colocated_text, save_tiny_deepseek
from test_pd_workers import Cluster, QueueSink
from test_pd_workers import request as client_request

from bootstrap.client import BootstrapClient
from kv_transfer import unavailable_reason
from serving.config import WorkerConfig
from serving.delta import Delta
from serving.parsing.request import parse_request
from serving.router.fleet import FleetSnapshot
from serving.router.launch import ChildCall
from serving.router.orchestrator import RoutedRequest
from serving.router.responder import EnsembleResponder
from serving.workers.pd_factory import create_pd_worker

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

VOCAB = 128
PROMPTS = ["t3 t17 t60 t5 t9", " ".join(f"t{(7 * i + 3) % VOCAB}" for i in range(37)), "t7",
           " ".join(f"t{(5 * i + 1) % VOCAB}" for i in range(13))]
NUM_PAGES = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_deepseek(tmp_path_factory.mktemp("tiny_deepseek_v3"))


@pytest.fixture(scope="module")
def colocated(folder: Path) -> dict[str, str]:
    return {p: colocated_text(folder, p) for p in PROMPTS}


@pytest.fixture(scope="module", params=[("inprocess", 2, 2), ("inprocess", 2, 1), ("inprocess", 1, 2),
                                        pytest.param(("nixl", 2, 2), marks=pytest.mark.nixl),
                                        pytest.param(("mooncake", 2, 2), marks=pytest.mark.mooncake)],
                ids=["dp-to-dp", "dp-to-one", "one-to-dp", "dp-to-dp-nixl", "dp-to-dp-mooncake"])
def cluster(request: pytest.FixtureRequest, folder: Path) -> Iterator[Cluster]:
    backend, p_ranks, d_ranks = request.param
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)

    def config(ranks: int) -> WorkerConfig:
        return WorkerConfig(model=str(folder), page_size=4, num_pages=NUM_PAGES, chunk_size=8,
                            max_num_batched_tokens=16, kv_backend=backend, bootstrap_timeout_s=5.0,
                            waiting_timeout_s=5.0, expert_parallel_size=ranks, enable_dp_attention=ranks > 1)

    ids = (f"prefill-dp{p_ranks}@127.0.0.1:1", f"decode-dp{d_ranks}-{backend}@127.0.0.1:1")
    prefill = create_pd_worker("prefill", config(p_ranks), ids[0])
    decode = create_pd_worker("decode", config(d_ranks), ids[1])
    prefill.start()
    decode.start()
    yield Cluster(prefill, decode, ids)
    decode.stop()
    prefill.stop()
    for handle in (prefill, decode):
        handle.loop.engine.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_registration_lists_the_dp_ranks_before_the_loop_ticks(folder: Path, role: str) -> None:
    """A router's first view of a DP instance is its registration, which ``PDWorkerHandle.start`` sends before
    the engine loop's first tick: it lists each rank's free pages already, so a request sent before the first
    heartbeat gets a rank chosen too (the engine loop is never started here)."""
    config = WorkerConfig(model=str(folder), page_size=4, num_pages=NUM_PAGES, kv_backend="inprocess",
                          expert_parallel_size=2, enable_dp_attention=True)
    handle = create_pd_worker(role, config, f"{role}-first@127.0.0.1:1")
    try:
        handle.kv_manager.start()   # registers at its rendezvous
        (status,) = BootstrapClient(handle.kv_manager.rendezvous_url).list_instances()
        assert status.load.rank_free_pages == [NUM_PAGES] * 2 and status.load.num_total_pages == 2 * NUM_PAGES
    finally:
        handle.kv_manager.shutdown(5.0)
        handle.loop.engine.close()


def test_streams_equal_colocated_and_each_dp_side_uses_both_ranks(cluster: Cluster, colocated: dict[str, str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: dict[str, list[int | None]] = {"prefill": [], "decode": []}   # the router's ranks, per role
    launcher = cluster._launcher
    stream = launcher.stream

    def recording(call: ChildCall) -> AsyncIterator[Delta]:
        chosen[call.role].append(call.target.dp_rank)
        return stream(call)

    monkeypatch.setattr(launcher, "stream", recording)
    engines = (cluster.prefill.loop.engine, cluster.decode.loop.engine)
    deadline = time.monotonic() + 10   # the first load reports, which list a DP side's ranks
    while any(len(s.load.rank_free_pages) != (e.config.dp_size if e.config.dp_size > 1 else 0)
              for client, e in zip(cluster.clients, engines) for s in client.list_instances()):
        assert time.monotonic() < deadline, "no load report lists the DP ranks"
        time.sleep(0.1)
    for handle, engine in zip((cluster.prefill, cluster.decode), engines):
        ranks = engine.config.dp_size
        assert handle.kv_manager.args.layout.num_pages == ranks * NUM_PAGES
        assert engine.num_total_pages == ranks * NUM_PAGES
    start = cluster.free_pages()
    before = [[load.requests for load in e.dp_loads] for e in engines]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda p: cluster.generate(client_request(p, max_tokens=20, ignore_eos=True)), PROMPTS))
    for prompt, deltas in zip(PROMPTS, results):
        assert not [d.error for d in deltas if d.error], deltas
        assert "".join(d.text for d in deltas) == colocated[prompt], prompt
    for role, engine, was in zip(("prefill", "decode"), engines, before):
        if engine.config.dp_size > 1:   # each request ran on the rank the router chose for it
            served = [load.requests - b for load, b in zip(engine.dp_loads, was)]
            assert sum(served) == len(PROMPTS) and min(served) >= 1, served
            assert served == [chosen[role].count(rank) for rank in (0, 1)], (role, chosen[role])
        else:                           # an instance of one pool is sent no rank
            assert chosen[role] == [None] * len(PROMPTS), (role, chosen[role])
    assert cluster.wait_free(start) == start
    deadline = time.monotonic() + 10   # the rendezvous' status: per-rank free pages of a DP side, idle again
    expected = {e.config.dp_size: [NUM_PAGES] * 2 if e.config.dp_size > 1 else [] for e in engines}
    queued = {e.config.dp_size: [0] * 2 if e.config.dp_size > 1 else [] for e in engines}
    while time.monotonic() < deadline:
        loads = [s.load for client in cluster.clients for s in client.list_instances()]
        if [load.rank_free_pages for load in loads] == [expected[e.config.dp_size] for e in engines]:
            break
        time.sleep(0.1)
    assert [load.rank_free_pages for load in loads] == [expected[e.config.dp_size] for e in engines]
    assert [load.rank_queued_prompt_tokens for load in loads] == [queued[e.config.dp_size] for e in engines]


def burst_prompts(count: int = 32) -> list[tuple[str, int]]:
    """``count`` prompts of 1-16 tokens, each starting with a token of its own (no prompt shares a page with
    another, so no prefix cache hit skews the tokens computed), each with its number of new tokens (2-4)."""
    gen = random.Random(47)
    prompts = []
    for i in range(count):
        ids = [3 + i] + [gen.randrange(3, VOCAB) for _ in range(gen.randint(0, 15))]
        prompts.append((" ".join(f"t{t}" for t in ids), 2 + i % 3))
    return prompts


def colocated_batch(folder: Path, prompts: list[tuple[str, int]]) -> list[str]:
    """Greedy texts of ``prompts`` run together on one colocated single-rank engine."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(folder), page_size=4, num_pages=4 * NUM_PAGES))
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    texts = [""] * len(prompts)
    while engine.has_unfinished():
        for output in engine.step():
            texts[int(output.request_id)] += output.new_text
    engine.close()
    return texts


def statuses(cluster: Cluster) -> FleetSnapshot:
    taken_s = time.monotonic()
    return FleetSnapshot(tuple(s for client in cluster.clients for s in client.list_instances()), taken_s)


async def serve_concurrently(cluster: Cluster, inputs: list[dict[str, str | bool]]) -> list[list[Delta]]:
    """Every request at once on one event loop (the router's); each request's client chunks."""
    async def one(raw: dict[str, str | bool]) -> list[Delta]:
        sink = QueueSink()
        routed = RoutedRequest(parse_request(raw), raw)
        emit = EnsembleResponder(routed.request, sink).emit
        await cluster.orchestrator.generate(routed, emit, lambda: False)
        return list(sink.responses.queue)

    return await asyncio.gather(*(one(raw) for raw in inputs))


@pytest.mark.parametrize("cluster", [("inprocess", 2, 2)], ids=["dp-to-dp"], indirect=True)
def test_32_concurrent_requests_keep_the_router_chosen_ranks_within_1_5x(
        cluster: Cluster, folder: Path, monkeypatch: pytest.MonkeyPatch,
        record_property: pytest.RecordProperty) -> None:
    """32 requests sent at once: the router chooses every rank before any load report or end comes back, so
    its own assignments (``Candidate.ranks``) are what spread them; the engines' per-rank counters
    (``dp_loads``) then say what each rank served. Run with ``--junitxml`` (``-o junit_family=legacy``) the
    figures land in the report as properties."""
    prompts = burst_prompts()
    chosen: dict[str, list[int | None]] = {"prefill": [], "decode": []}
    stream = cluster._launcher.stream

    def recording(call: ChildCall) -> AsyncIterator[Delta]:
        chosen[call.role].append(call.target.dp_rank)
        return stream(call)

    monkeypatch.setattr(cluster._launcher, "stream", recording)
    engines = {"prefill": cluster.prefill.loop.engine, "decode": cluster.decode.loop.engine}
    deadline = time.monotonic() + 10   # both sides report their ranks, idle: the burst starts from even ranks
    while any(s.load.rank_free_pages != [NUM_PAGES] * 2 for s in statuses(cluster).instances):
        assert time.monotonic() < deadline, "no load report lists the DP ranks idle"
        time.sleep(0.1)
    cluster.fleet.update(statuses(cluster))
    start = cluster.free_pages()
    before = {role: [(load.requests, load.tokens) for load in e.dp_loads] for role, e in engines.items()}
    results = asyncio.run(serve_concurrently(
        cluster, [client_request(p, max_tokens=n, ignore_eos=True) for p, n in prompts]))
    for (prompt, _), deltas, text in zip(prompts, results, colocated_batch(folder, prompts)):
        assert not [d.error for d in deltas if d.error], deltas
        assert "".join(d.text for d in deltas) == text, prompt
    expected = {"prefill": sum(len(p.split()) for p, _ in prompts),   # every prompt token, once
                "decode": sum(n - 1 for _, n in prompts)}                 # the first token is the prefill's
    for role, engine in engines.items():
        requests = [load.requests - b[0] for load, b in zip(engine.dp_loads, before[role])]
        tokens = [load.tokens - b[1] for load, b in zip(engine.dp_loads, before[role])]
        record_property(f"{role}_rank_requests", requests)
        record_property(f"{role}_rank_tokens", tokens)
        assert requests == [chosen[role].count(rank) for rank in (0, 1)], (role, chosen[role])
        assert (sum(requests), sum(tokens)) == (len(prompts), expected[role]), (role, requests, tokens)
        assert max(requests) <= 1.5 * min(requests), (role, requests, tokens)
        assert max(tokens) <= 1.5 * min(tokens), (role, requests, tokens)
    assert cluster.wait_free(start) == start
