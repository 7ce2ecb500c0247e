"""Expert parallelism in a real tritonserver (issue #46), one server holding two PD pairs over NIXL:

* a tiny random DeepSeek-V3 (MLA, 8 experts, top-2, fp32) served by ``pd_ensemble`` with prefill at
  ``expert_parallel_size`` 2 and decode at 1, beside a ``colocated`` model at ``expert_parallel_size`` 2;
* a tiny random Qwen3-MoE (GQA, 2 KV heads, 8 experts, top-2, fp32) served by ``pd_qwen`` (a second router,
  its fleet held to its own pair by ``prefill_models`` / ``decode_models``) with prefill ``prefill_qwen`` at
  ``expert_parallel_size`` 1 and decode ``decode_qwen`` at 2.

Invariants: each EP=2 stub has started one rank process and no other stub any; every DeepSeek PD stream and
every colocated EP=2 stream equals an in-process EP=1 colocated engine's greedy text, so the latent KV both
prefill ranks held crossed to decode, and tokens crossed ranks to their experts; every Qwen3-MoE PD stream,
run at once, equals an in-process EP=1 colocated engine's greedy run (text, token ids, each token's logprob
within ``LOGPROB_TOL``), so each decode rank received its KV head of every prompt token from one prefill pool,
and the decode steps ran with a batch whose MoE share on one rank was empty (batch 1) or not; KV bytes crossed
from both prefill models; kill -9 of the colocated model's rank 1 under a request ends that request with an
error naming the rank within seconds (no hang), and the server then ends, as when a stub dies
(``serving.workers.fatal``). Teardown stops the server if it runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_client import StreamResult, grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import colocated_greedy_runs, colocated_greedy_texts
from perf.server import Deployment, RunningServer, ServerPorts, free_ports, stub_pids
from test_moe_pd_workers import save_tiny_deepseek

from tests.engine.test_moe_models import qwen3_moe_config, save_model

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]

PROMPTS = ["t3 t17 t60 t5 t9", " ".join(f"t{(7 * i + 3) % 128}" for i in range(37))]
GREEDY = {"max_tokens": "12", "temperature": "0", "ignore_eos": "true"}
QWEN_PROMPTS = ["t3 t17 t60 t5 t9", "t7", " ".join(f"t{(5 * i + 1) % 128}" for i in range(13))]
QWEN_GREEDY = {"max_tokens": "8", "temperature": "0", "ignore_eos": "true", "logprobs": "1"}
#: Largest difference allowed between a token's logprob through PD (P EP=1 -> D EP=2) and colocated EP=1's,
#: fp32. EP=2 sums the attention's row-parallel products over the ranks instead of inside one matmul, so its
#: numbers differ from EP=1's in the last bits (the engine test of EP=2 holds them to 1e-4 as well); a KV head
#: from the wrong rank, token or page changes the attention itself (the greedy ids are compared exactly).
LOGPROB_TOL = 1e-4
ERROR_WITHIN_S = 5.0
#: the stub's exit grace (``serving.workers.fatal.GRACE_S``) and the guardian's SIGTERM, then SIGKILL
SERVER_GONE_WITHIN_S = 40.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return save_tiny_deepseek(tmp_path_factory.mktemp("ep-live"))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("ep-live-qwen3-moe")
    save_model(folder, qwen3_moe_config())
    return folder


@pytest.fixture(scope="module")
def server(tiny: Path, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    pytest.importorskip("pytriton")
    common = {"model": str(tiny), "num_pages": "128", "tp_timeout_s": "5"}
    ep2 = {**common, "expert_parallel_size": "2"}
    qwen = {**common, "model": str(tiny_qwen)}
    deployment = Deployment(
        name="ep", entry_model="pd_ensemble",
        models=("pd_ensemble", "prefill", "decode", "colocated", "pd_qwen", "prefill_qwen", "decode_qwen"),
        overrides={"pd_ensemble": {"prefill_models": "prefill", "decode_models": "decode"},
                   "prefill": ep2, "decode": common, "colocated": ep2,
                   "pd_qwen": {"prefill_models": "prefill_qwen", "decode_models": "decode_qwen"},
                   "prefill_qwen": qwen, "decode_qwen": {**qwen, "expert_parallel_size": "2"}},
        copies={"pd_qwen": "pd_ensemble", "prefill_qwen": "prefill", "decode_qwen": "decode"})
    running = RunningServer(deployment, ServerPorts(*free_ports(3)), tmp_path_factory.mktemp("ep-logs"),
                            ready_timeout_s=300.0)
    with running:
        yield running


def rank_pids(server: RunningServer, model: str) -> list[int]:
    """The rank processes ``model``'s stub started (children running ``engine.parallel.rank_worker``)."""
    assert server.repository is not None
    pids = []
    for stub in stub_pids(server.repository / model):
        children = subprocess.run(["pgrep", "-P", str(stub)], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in children
                 if b"engine.parallel.rank_worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pids


def test_pd_with_prefill_ep2_and_colocated_ep2_equal_a_colocated_ep1_engine(server: RunningServer,
                                                                            tiny: Path) -> None:
    assert len(rank_pids(server, "prefill")) == 1 and len(rank_pids(server, "colocated")) == 1
    assert rank_pids(server, "decode") == []
    reference = colocated_greedy_texts(PROMPTS, GREEDY, sequential=True, model=str(tiny))
    assert len(set(reference.values())) == len(PROMPTS)
    for model in ("pd_ensemble", "colocated"):
        streams_match_reference(
            lambda p, m=model: grpc_generate(server.ports.grpc_url, make_inputs(p, GREEDY), model=m),
            PROMPTS, reference)
    assert metric_value(server.ports.metrics_url, "pd_kv_transfer_bytes_total", model="prefill") > 0


def test_qwen3_moe_pd_with_decode_ep2_equals_a_colocated_ep1_engine_tokens_and_logprobs(
        server: RunningServer, tiny_qwen: Path) -> None:
    assert len(rank_pids(server, "decode_qwen")) == 1 and rank_pids(server, "prefill_qwen") == []
    runs = colocated_greedy_runs(QWEN_PROMPTS, QWEN_GREEDY, sequential=True, model=str(tiny_qwen))
    reference = {prompt: text for prompt, (text, _) in runs.items()}
    assert len(set(reference.values())) == len(QWEN_PROMPTS)
    results = streams_match_reference(
        lambda p: grpc_generate(server.ports.grpc_url, make_inputs(p, QWEN_GREEDY, return_logprobs=True),
                                model="pd_qwen"),
        QWEN_PROMPTS, reference)
    for prompt, result in zip(QWEN_PROMPTS, results):
        expected = runs[prompt][1]
        assert [t for t, _ in result.token_logprobs] == [t for t, _ in expected] and expected, prompt
        worst = max(abs(a - b) for (_, a), (_, b) in zip(result.token_logprobs, expected))
        assert worst <= LOGPROB_TOL, (prompt, worst)
    assert metric_value(server.ports.metrics_url, "pd_kv_transfer_bytes_total", model="prefill_qwen") > 0


def kill_rank_under_a_request(server: RunningServer, rank_pid: int, prompt: str,
                              model: str = "colocated") -> tuple[StreamResult, float]:
    """Start a long greedy request on ``model``, SIGKILL ``rank_pid`` once it streams; (its result, when the
    kill was sent). Fails the test when the request never streams or does not end within 30 s."""
    started = threading.Event()
    result: list[StreamResult] = []
    long = {"max_tokens": "240", "temperature": "0", "ignore_eos": "true"}   # within 256 positions
    request = threading.Thread(target=lambda: result.append(grpc_generate(
        server.ports.grpc_url, make_inputs(prompt, long), model=model, on_first_text=started.set)))
    request.start()
    assert started.wait(60), "the long request never streamed"
    killed_at = time.monotonic()
    os.kill(rank_pid, signal.SIGKILL)
    request.join(30)
    assert result, "the request did not end"
    return result[0], killed_at


def assert_server_ends(server: RunningServer) -> None:
    """The server is gone within ``SERVER_GONE_WITHIN_S`` (the stub exits after its grace; its guardian ends
    the server)."""
    deadline = time.monotonic() + SERVER_GONE_WITHIN_S
    while time.monotonic() < deadline:
        try:
            server.check_alive("the rank's death")
        except RuntimeError:
            return
        time.sleep(0.2)
    pytest.fail(f"the server outlived its dead rank by {SERVER_GONE_WITHIN_S:g} s")


def test_rank_1_killed_under_a_request_ends_it_with_an_error_and_then_the_server(
        server: RunningServer) -> None:
    (rank1,) = rank_pids(server, "colocated")
    got, killed_at = kill_rank_under_a_request(server, rank1, PROMPTS[0])
    assert got.error is not None and "expert-parallel group failed" in got.error, got
    assert f"rank 1 (pid {rank1}) was killed by signal 9" in got.error
    assert got.end_s is not None and got.end_s - killed_at < ERROR_WITHIN_S
    assert_server_ends(server)
