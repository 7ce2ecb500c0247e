"""DP attention in a real tritonserver (issue #47): a tiny random DeepSeek-V3 (MLA, 8 experts, top-2, fp32)
served by ``pd_ensemble`` with prefill and decode each at ``expert_parallel_size`` 2 with
``enable_dp_attention``, over NIXL, beside a ``colocated`` model the same way, and the mixed pairings (two
more routers, each held to its pair: DP prefill -> a one-rank decode, a one-rank prefill -> DP decode).

Invariants: each DP stub has started one rank process; every PD stream and every colocated stream (4 at
once) equals an in-process single-rank colocated engine's greedy text,
so each request's latent KV crossed from its prefill rank's pool to its decode rank's; each DP model served
them on both ranks (``pd_dp_rank_requests_total``), the PD ones on the ranks the router chose
(``pd_router_dp_rank_selections_total`` equals them rank by rank); a prompt sent again is paired to the ranks
holding its prefix (prefill's and decode's prefix caches both hit); the mixed pairings' streams equal the same
reference, the router choosing a rank on the DP side only; kill -9 of the
colocated model's rank 1 under a request ends that request with an error naming the rank within seconds (no
hang), and the server then ends, as when a stub dies (``serving.workers.fatal``). Teardown stops the server if
it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_client import grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import colocated_greedy_texts
from perf.server import Deployment, RunningServer, ServerPorts, free_ports
from test_expert_parallel_live import (
    ERROR_WITHIN_S,
    assert_server_ends,
    kill_rank_under_a_request,
    rank_pids,
)
from test_moe_pd_workers import save_tiny_deepseek

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]

PROMPTS = ["t3 t17 t60 t5 t9", " ".join(f"t{(7 * i + 3) % 128}" for i in range(37)), "t7 t7 t1",
           " ".join(f"t{(5 * i + 1) % 128}" for i in range(13))]
GREEDY = {"max_tokens": "12", "temperature": "0", "ignore_eos": "true"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return save_tiny_deepseek(tmp_path_factory.mktemp("dp-live"))


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    pytest.importorskip("pytriton")
    dp2 = {"model": str(tiny), "num_pages": "128", "tp_timeout_s": "5", "expert_parallel_size": "2",
           "enable_dp_attention": "true"}
    one = {"model": str(tiny), "num_pages": "128"}
    deployment = Deployment(
        name="dp", entry_model="pd_ensemble",
        models=("pd_ensemble", "prefill", "decode", "colocated", "prefill_one", "decode_one", "pd_dp_to_one",
                "pd_one_to_dp"),
        overrides={"prefill": dp2, "decode": dp2, "colocated": dp2, "prefill_one": one, "decode_one": one,
                   # each router held to its pair (the mixed ones: DP prefill -> one-rank decode, and back)
                   "pd_ensemble": {"prefill_models": "prefill", "decode_models": "decode"},
                   "pd_dp_to_one": {"prefill_models": "prefill", "decode_models": "decode_one"},
                   "pd_one_to_dp": {"prefill_models": "prefill_one", "decode_models": "decode"}},
        copies={"prefill_one": "prefill", "decode_one": "decode", "pd_dp_to_one": "pd_ensemble",
                "pd_one_to_dp": "pd_ensemble"})
    running = RunningServer(deployment, ServerPorts(*free_ports(3)), tmp_path_factory.mktemp("dp-logs"),
                            ready_timeout_s=300.0)
    with running:
        yield running


def test_pd_and_colocated_with_dp_attention_equal_a_single_rank_engine(server: RunningServer,
                                                                        tiny: Path) -> None:
    for model in ("prefill", "decode", "colocated"):
        assert len(rank_pids(server, model)) == 1, model
    reference = colocated_greedy_texts(PROMPTS, GREEDY, sequential=True, model=str(tiny))
    assert len(set(reference.values())) == len(PROMPTS)
    for model in ("pd_ensemble", "colocated"):
        streams_match_reference(
            lambda p, m=model: grpc_generate(server.ports.grpc_url, make_inputs(p, GREEDY), model=m),
            PROMPTS, reference)
    assert metric_value(server.ports.metrics_url, "pd_kv_transfer_bytes_total", model="prefill") > 0
    deadline = time.monotonic() + 5   # each DP model served on both ranks (the metrics hook runs every tick)
    for model in ("prefill", "decode", "colocated"):
        served = [0.0, 0.0]
        while min(served) == 0 and time.monotonic() < deadline:
            served = [_requests(server, model, rank) for rank in (0, 1)]
            time.sleep(0.1)
        assert min(served) >= 1 and sum(served) == len(PROMPTS), (model, served)
    for role in ("prefill", "decode"):   # each PD request ran on the ranks the router chose for it
        chosen = [_chosen(server, role, rank) for rank in (0, 1)]
        assert chosen == [_requests(server, role, rank) for rank in (0, 1)], (role, chosen)
    # a prompt sent again goes back to the ranks holding its prefix: both prefix caches hit
    hits = {role: _hit_tokens(server, role) for role in ("prefill", "decode")}
    again = grpc_generate(server.ports.grpc_url, make_inputs(PROMPTS[1], GREEDY), model="pd_ensemble")
    assert again.error is None and again.text == reference[PROMPTS[1]]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_hit_tokens(server, r) == h for r, h in hits.items()):
        time.sleep(0.1)
    assert all(_hit_tokens(server, r) > h for r, h in hits.items()), hits
    for role in ("prefill", "decode"):
        assert [_chosen(server, role, r) for r in (0, 1)] == [_requests(server, role, r) for r in (0, 1)]


def test_mixed_pairings_dp_prefill_to_one_rank_decode_and_back_equal_a_single_rank_engine(
        server: RunningServer, tiny: Path) -> None:
    """DP prefill (2 ranks) -> a one-rank decode, and a one-rank prefill -> DP decode: each request's latent
    KV goes from the rank that computed it to the pool that decodes it; streams (4 at once) equal the
    reference; the router chose a rank on the DP side only."""
    reference = colocated_greedy_texts(PROMPTS, GREEDY, sequential=True, model=str(tiny))
    for router in ("pd_dp_to_one", "pd_one_to_dp"):
        streams_match_reference(
            lambda p, m=router: grpc_generate(server.ports.grpc_url, make_inputs(p, GREEDY), model=m),
            PROMPTS, reference)
    assert sum(_chosen(server, "prefill", r, "pd_dp_to_one") for r in (0, 1)) == len(PROMPTS)
    assert sum(_chosen(server, "decode", r, "pd_one_to_dp") for r in (0, 1)) == len(PROMPTS)
    assert sum(_chosen(server, "decode", r, "pd_dp_to_one") for r in (0, 1)) == 0   # one rank: no choice
    for model in ("prefill_one", "decode_one"):
        assert metric_value(server.ports.metrics_url, "pd_kv_transfers_total", model=model) >= len(PROMPTS)


def _requests(server: RunningServer, model: str, rank: int) -> float:
    try:
        return metric_value(server.ports.metrics_url, "pd_dp_rank_requests_total", model=model,
                            rank=str(rank))
    except KeyError:
        return 0.0


def _chosen(server: RunningServer, role: str, rank: int, router: str = "pd_ensemble") -> float:
    """Requests ``router`` sent to ``role``'s DP rank ``rank`` (its own count, as it chose)."""
    try:
        return metric_value(server.ports.metrics_url, "pd_router_dp_rank_selections_total",
                            model=router, role=role, rank=str(rank))
    except KeyError:
        return 0.0


def _hit_tokens(server: RunningServer, model: str) -> float:
    try:
        return metric_value(server.ports.metrics_url, "pd_prefix_cache_hits_tokens_total", model=model)
    except KeyError:
        return 0.0


def test_rank_1_killed_under_a_request_ends_it_with_an_error_and_then_the_server(
        server: RunningServer) -> None:
    (rank1,) = rank_pids(server, "colocated")
    # the request runs on rank 0: rank 1 is idle, in the step's collectives
    got, killed_at = kill_rank_under_a_request(server, rank1, PROMPTS[0])
    assert got.error is not None and f"rank 1 (pid {rank1}) was killed by signal 9" in got.error, got
    assert got.end_s is not None and got.end_s - killed_at < ERROR_WITHIN_S
    assert_server_ends(server)
