"""``colocated`` with ``tensor_parallel_size`` 2 in a real tritonserver (a tiny random Llama, fp32).

Invariants: the stub is rank 0 and has started rank 1 as a process of its own; concurrent greedy streams give
the text and the cumulative logprob (within 1e-4) of an in-process engine with one rank; kill -9 of rank 1
under a request ends that request with an error naming the rank within seconds, a later request gets the same
error at once (the engine takes no more work), and the server then ends, as when a stub dies
(``serving.workers.fatal``: the stub exits, its guardian ends the server for its supervisor to replace).
Teardown stops the server (SIGTERM) if it still runs.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from live_client import make_inputs
from perf.server import Deployment, RunningServer, ServerPorts, free_ports, stub_pids

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.timeout(600)]

#: 4 attention heads over 2 KV heads: each rank holds one KV head
SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
PROMPTS = ["The capital of France is", "Once upon a time", "Write a short list of three fruits:\n1.",
           "The river wound through the valley, past orchards and stone bridges. " * 6 + "Summarize:"]
GREEDY = {"max_tokens": "16", "temperature": "0", "ignore_eos": "true"}
ERROR_WITHIN_S = 5.0
#: the stub's exit grace (``serving.workers.fatal.GRACE_S``) and the guardian's SIGTERM, then SIGKILL
SERVER_GONE_WITHIN_S = 40.0


@dataclass
class Generation:
    text: str = ""
    cumulative_logprob: float = 0.0
    error: str | None = None
    first_text_s: float | None = None
    end_s: float = 0.0


def generate(url: str, prompt: str, params: dict[str, Any],
             started: threading.Event | None = None) -> Generation:
    """One streamed request: its text, last cumulative logprob, or its error (the ``colocated`` model)."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    out = Generation()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer("colocated", make_inputs(prompt, params, return_cumulative_logprob=True),
                                  enable_empty_final_response=True)
        while True:
            res, err = events.get(timeout=120)
            if err is not None:
                out.error, out.end_s = str(err), time.monotonic()
                return out
            text = res.as_numpy("text_output")
            if text is not None:
                out.text += b"".join(text.reshape(-1)).decode()
                out.cumulative_logprob = float(res.as_numpy("cumulative_logprob").reshape(-1)[0])
                if out.first_text_s is None and out.text:
                    out.first_text_s = time.monotonic()
                    if started is not None:
                        started.set()
            params_ = res.get_response().parameters
            if "triton_final_response" in params_ and params_["triton_final_response"].bool_param:
                out.end_s = time.monotonic()
                return out
    finally:
        client.stop_stream()
        client.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perf.tiny_model import build_random_llama

    return build_random_llama(tmp_path_factory.mktemp("tp-live") / "tiny", 0, SHAPE, "tp-live", std=0.2)


@pytest.fixture(scope="module")
def server(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    pytest.importorskip("pytriton")
    params = {"model": str(tiny), "tensor_parallel_size": "2", "num_pages": "256", "tp_timeout_s": "5"}
    deployment = Deployment(name="tp", entry_model="colocated", models=("colocated",),
                            overrides={"colocated": params})
    running = RunningServer(deployment, ServerPorts(*free_ports(3)), tmp_path_factory.mktemp("tp-logs"),
                            ready_timeout_s=300.0)
    with running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[str, Generation]:
    """Each prompt's greedy text and cumulative logprob from one in-process engine with one rank."""
    from engine import LLMEngine
    from serving.config import WorkerConfig
    from serving.parsing.prompt import prompt_token_ids
    from serving.parsing.request import parse_request

    engine = LLMEngine(WorkerConfig(model=str(tiny), num_pages=256).engine_config("colocated"))
    out = {p: Generation() for p in PROMPTS}
    for i, prompt in enumerate(PROMPTS):
        req = parse_request({"text_input": prompt.encode(), "sampling_parameters": json.dumps(GREEDY)})
        engine.add_request(str(i), prompt_token_ids(engine.tokenizer, req), req.params)
    while engine.has_unfinished():
        for o in engine.step():
            got = out[PROMPTS[int(o.request_id)]]
            got.text += o.new_text
            got.cumulative_logprob = o.cumulative_logprob
    return out


def rank_pids(server: RunningServer) -> list[int]:
    """The rank processes the colocated stub started (children running ``engine.parallel.rank_worker``)."""
    assert server.repository is not None
    pids = []
    for stub in stub_pids(server.repository / "colocated"):
        children = subprocess.run(["pgrep", "-P", str(stub)], capture_output=True, text=True).stdout.split()
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"engine.parallel.rank_worker" in cmdline:
                pids.append(int(pid))
    return pids


def test_tp2_streams_give_the_one_rank_engines_text_and_logprobs(server: RunningServer,
                                                                  reference: dict[str, Generation]) -> None:
    assert len(rank_pids(server)) == 1
    results: dict[str, Generation] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, generate(server.ports.grpc_url, p,
                                                                                   GREEDY)))
               for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len({r.text for r in reference.values()}) == len(PROMPTS)
    for prompt in PROMPTS:
        got, want = results[prompt], reference[prompt]
        assert got.error is None, got.error
        assert got.text == want.text, prompt
        assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-4, prompt


def test_rank_1_killed_under_a_request_ends_it_with_an_error_within_seconds(server: RunningServer) -> None:
    (rank1,) = rank_pids(server)
    started = threading.Event()
    result: list[Generation] = []
    long = {"max_tokens": "3000", "temperature": "0", "ignore_eos": "true"}
    request = threading.Thread(target=lambda: result.append(generate(server.ports.grpc_url, PROMPTS[1], long,
                                                                     started)))
    request.start()
    assert started.wait(60), "the long request never streamed"
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    request.join(30)
    assert result, "the request did not end"
    got = result[0]
    assert got.error is not None and "tensor-parallel group failed" in got.error, got
    assert f"rank 1 (pid {rank1}) was killed by signal 9" in got.error
    assert got.end_s - killed_at < ERROR_WITHIN_S
    later = generate(server.ports.grpc_url, PROMPTS[0], GREEDY)
    assert later.error is not None and "tensor-parallel group failed" in later.error
    deadline = time.monotonic() + SERVER_GONE_WITHIN_S   # the stub exits after its grace; the guardian ends
    while time.monotonic() < deadline:                    # the server
        try:
            server.check_alive("the rank's death")
        except RuntimeError:
            return
        time.sleep(0.2)
    pytest.fail(f"the server outlived its dead rank by {SERVER_GONE_WITHIN_S:g} s")
