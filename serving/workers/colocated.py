"""``ColocatedWorker``: prefill and decode in one engine, behind the Triton LLM convention.

Lifecycle of one request:

1. ``handle`` (Triton's execute thread): apply the chat template if asked, tokenize, register a
   ``GenerationStream``, ``EngineLoop.submit``;
2. loop thread: the request joins the continuous batch; each step's output goes to its stream, which sends
   responses through the request's ``ResponseSink``;
3. every tick (``on_tick``), each live stream's sink is asked ``is_cancelled()``; a cancelled request is
   aborted in the engine (its pages are freed at once) and its stream ends with FINAL alone;
4. the terminal event (finished, failed, aborted, loop stopped) sends the FINAL flag and drops the stream.

Thread ownership: ``_streams`` is shared by the execute thread (adds) and the loop thread (removes, polls),
under ``_lock``; responses are sent from the loop thread only, except a submit refused by a stopped loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from engine.errors import EngineError, InvalidSamplingParams
from serving.config import WorkerConfig
from serving.delta import ErrorKind
from serving.events import LoopEvent, LoopStopped, RequestId
from serving.metrics import DPRankMetricsHook, LoopMetricsHook, ServingMetrics
from serving.parsing.prompt import Tokenizer, prompt_token_ids
from serving.parsing.request import GenerateRequest, RequestError
from serving.stream import GenerationStream, ResponseSink
from serving.workers.engine_loop import EngineLoop
from serving.workers.parallel_sampling import SampleFanIn

logger = logging.getLogger(__name__)


class ColocatedWorker:
    """Serves generation requests with one colocated engine on one ``EngineLoop``."""

    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer, name: str = "colocated",
                 metrics: ServingMetrics | None = None,
                 close_engine: Callable[[], None] | None = None) -> None:
        """Register this worker's cancellation hook on ``loop``; starts nothing.

        Args:
            loop: the loop driving a ``"colocated"``-mode engine (not started yet).
            tokenizer: the engine's tokenizer.
            name: prefix of the engine request ids (unique per instance, shows in logs).
            metrics: where to count finished requests; None disables.
            close_engine: called by ``stop`` once the loop stopped (``LLMEngine.close``: a tensor-parallel
                engine's rank processes end there); None: nothing to close.
        """
        self._loop = loop
        self._close_engine = close_engine
        self._tokenizer = tokenizer
        self._name = name
        self._metrics = metrics
        self._streams: dict[RequestId, GenerationStream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        loop.add_hook(self)

    @classmethod
    def create(cls, config: WorkerConfig, name: str = "colocated", metrics: ServingMetrics | None = None,
               on_fatal: Callable[[EngineError], None] | None = None) -> ColocatedWorker:
        """Build the engine (loads the model: seconds), its loop and the worker. Starts nothing. ``on_fatal``:
        as ``EngineLoop``'s (an engine failed for good, e.g. a tensor-parallel rank died)."""
        from engine import LLMEngine  # heavy import (torch): only when a worker is built

        engine = LLMEngine(config.engine_config("colocated"))
        if engine.parallel is not None:   # the rank processes run at the engine loop thread's priority
            engine.parallel.set_nice(config.engine_nice)
        loop = EngineLoop(engine, name=f"{name}-engine-loop", idle_wait_s=config.idle_wait_s,
                          nice=config.engine_nice, on_fatal=on_fatal)
        if metrics is not None:
            loop.add_hook(LoopMetricsHook(loop, metrics,
                                          lambda: (engine.num_free_pages, engine.num_total_pages),
                                          prefix_cache=engine.prefix_cache_stats))
            if engine.config.dp_size > 1:
                loop.add_hook(DPRankMetricsHook(metrics, lambda: engine.rank_free_pages,
                                                lambda: engine.dp_loads))
        return cls(loop, engine.tokenizer, name=name, metrics=metrics, close_engine=engine.close)

    @property
    def loop(self) -> EngineLoop:
        return self._loop

    def start(self) -> None:
        """Start the engine loop thread."""
        self._loop.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the loop; every request in flight ends with an error response and FINAL; then close the engine
        (a loop that did not stop in time leaves it: its rank processes, if any, end with this process).
        False on timeout."""
        stopped = self._loop.stop(timeout_s)
        if stopped and self._close_engine is not None:
            self._close_engine()
        return stopped

    def num_active(self) -> int:
        """Requests whose stream has not ended yet."""
        with self._lock:
            return len(self._streams)

    def handle(self, request: GenerateRequest, sink: ResponseSink) -> RequestId:
        """Start serving one request; its responses go to ``sink``. Never raises: failures go to the sink.

        A request with ``n > 1`` runs as ``n`` engine requests (``serving.workers.parallel_sampling``), ids
        ``<id>.0`` ... ``<id>.<n-1>``.

        Returns:
            The engine request id given to it (the common prefix of its samples' ids when ``n > 1``).
        """
        request_id = f"{self._name}-{next(self._ids)}"
        try:
            token_ids = prompt_token_ids(self._tokenizer, request)
        except Exception as e:  # noqa: BLE001 (a template or tokenizer error concerns this request only)
            logger.warning("request %s: tokenization failed: %s", request_id, e)
            sink.send_error(f"tokenization failed: {e}", ErrorKind.REQUEST)
            return request_id
        try:
            self._loop.prepare(request.params)  # the grammar compiles here, not on the engine thread
        except InvalidSamplingParams as e:
            sink.send_error(str(RequestError(f"sampling_parameters.{e.param}", e.reason)), ErrorKind.REQUEST)
            return request_id
        n = request.params.n
        if n == 1:
            self._start(request_id, request, token_ids, sink)
            return request_id
        fan_in = SampleFanIn(sink, n, request.stream, request.params.logprobs is not None)
        for i in range(n):
            sample = replace(request, params=request.params.for_sample(i))
            self._start(f"{request_id}.{i}", sample, token_ids, fan_in.sample_sink(i))
        return request_id

    def _start(self, request_id: RequestId, request: GenerateRequest, token_ids: list[int],
               sink: ResponseSink) -> None:
        stream = GenerationStream(request_id, request, sink)
        with self._lock:
            self._streams[request_id] = stream
        try:
            self._loop.submit(request_id, token_ids, request.params,
                              lambda event: self._on_event(stream, event))
        except LoopStopped as e:
            with self._lock:
                self._streams.pop(request_id, None)
            sink.send_error(str(e), ErrorKind.INSTANCE)

    def on_tick(self) -> bool:
        """Loop thread: abort the requests whose client cancelled. Never reports work in flight."""
        with self._lock:
            live = [s for s in self._streams.values() if not s.cancelled]
        for stream in live:
            if stream.sink.is_cancelled():
                stream.cancelled = True
                logger.info("request %s cancelled by the client", stream.request_id)
                self._loop.abort(stream.request_id, "cancelled by the client")
        return False

    def _on_event(self, stream: GenerationStream, event: LoopEvent) -> None:
        if not stream.on_event(event):
            return
        with self._lock:
            self._streams.pop(stream.request_id, None)
        if self._metrics is not None:
            outcome = "cancelled" if stream.cancelled else ("failed" if stream.error else "finished")
            self._metrics.request_done(outcome, stream.num_input_tokens, stream.num_output_tokens)
