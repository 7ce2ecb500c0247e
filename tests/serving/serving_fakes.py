"""Test doubles that implement the serving seams (``EngineCore``, ``ResponseSink``, metric families)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.errors import InvalidSamplingParams, RequestRejected
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from serving.delta import ErrorKind, ResponseChunk
from serving.stream import ResponseSink
from serving.workers.engine_loop import EngineCore


@dataclass
class _Req:
    prompt_len: int
    max_tokens: int
    produced: int = 0


class FakeEngine:
    """A one-page-per-token engine that emits ``"w{i} "`` per step; rejects prompts over ``max_prompt``."""

    def __init__(self, num_pages: int = 100, max_prompt: int = 50, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.num_total_pages = num_pages
        self.num_free_pages = num_pages
        self.max_prompt = max_prompt
        self.requests: dict[str, _Req] = {}
        self.calls = {"has_unfinished": 0, "step": 0}
        self.fail_next_step = False
        self.thread_ids: set[int] = set()
        self.prepare_thread_ids: set[int] = set()

    def prepare_request(self, params: SamplingParams) -> None:
        """Compiles nothing; refuses a spec whose regex is ``"reject-me"`` (as a grammar the vocabulary cannot
        compile would be)."""
        self.prepare_thread_ids.add(threading.get_ident())
        if params.structured is not None and params.structured.value == "reject-me":
            raise InvalidSamplingParams("structured_outputs.regex", "cannot be compiled: refused by the fake")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.thread_ids.add(threading.get_ident())
        need = len(prompt_token_ids) + params.max_tokens
        if request_id in self.requests:
            raise RequestRejected(request_id, "duplicate request id")
        if len(prompt_token_ids) > self.max_prompt or need > self.num_free_pages:
            raise RequestRejected(request_id, f"needs {need} pages")
        self.num_free_pages -= need
        self.requests[request_id] = _Req(len(prompt_token_ids), params.max_tokens)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.num_free_pages += req.prompt_len + req.max_tokens

    def has_unfinished(self) -> bool:
        self.calls["has_unfinished"] += 1
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.calls["step"] += 1
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outputs = []
        for request_id, req in list(self.requests.items()):
            req.produced += 1
            finished = req.produced == req.max_tokens
            outputs.append(RequestOutput(request_id, [req.produced], [0.0], f"w{req.produced} ", finished,
                                         "length" if finished else None, req.prompt_len, req.produced))
            if finished:
                self.abort_request(request_id)
        return outputs


_engine_check: EngineCore = FakeEngine()  # type-checks the fake against the protocol


@dataclass
class RecordingSink:
    """Records what a stream sends; ``cancelled`` simulates a client cancel."""

    chunks: list[tuple[ResponseChunk, bool]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_kinds: list[ErrorKind] = field(default_factory=list)
    finals: int = 0
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    touched_after_final: int = 0

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self._check()
        self.chunks.append((chunk, final))
        self._final(final)

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self._check()
        self.errors.append(message)
        self.error_kinds.append(kind)
        self._final(True)

    def close(self) -> None:
        self._check()
        self._final(True)

    def is_cancelled(self) -> bool:
        self._check()
        return self.cancelled

    @property
    def text(self) -> str:
        return "".join(c.text for c, _ in self.chunks)

    def _check(self) -> None:
        if self.finals:
            self.touched_after_final += 1

    def _final(self, final: bool) -> None:
        if final:
            self.finals += 1
            self.done.set()


_sink_check: ResponseSink = RecordingSink()


class FakeFamily:
    """``pb_utils.MetricFamily`` look-alike keeping values in memory."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    registry: ClassVar[dict[str, FakeFamily]] = {}

    def __init__(self, name: str, description: str, kind: Any) -> None:
        self.name, self.kind = name, kind
        self.series: dict[tuple[tuple[str, str], ...], FakeMetric] = {}
        FakeFamily.registry[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:
        assert (buckets is not None) == (self.kind == self.HISTOGRAM), f"{self.name}: buckets iff a histogram"
        return self.series.setdefault(tuple(sorted(labels.items())), FakeMetric())


class FakeMetric:
    def __init__(self) -> None:
        self._value = 0.0
        self.writes = 0
        self.observations: list[float] = []

    def observe(self, value: float) -> None:
        self.observations.append(value)
        self.writes += 1

    def set(self, value: float) -> None:
        self._value = value
        self.writes += 1

    def increment(self, value: float) -> None:
        self._value += value
        self.writes += 1

    def value(self) -> float:
        return self._value
