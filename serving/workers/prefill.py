"""``PrefillWorker``: the prefill half of PD disaggregation, on one engine in prefill mode.

Lifecycle of one request, every step but the first on the engine loop thread:

1. ``handle`` (Triton's execute thread): tokenize (or take the router's ids: ``Intake``); the job is queued
   for the loop;
2. the loop opens a KV sender for its room (``Bootstrapping`` until the decode side has posted where to
   write), declares the prompt's pages (``sender.init(num_pages, num_tokens)``) and submits the request at
   once: it joins the engine's **waiting** queue and runs with chunked prefill **while decode reserves its
   pages and posts the destination**, so the rendezvous is off the first token's path (vLLM's and Dynamo's
   prefill runs first too; SGLang's prefill waits in a bootstrap queue for decode's pages). After each chunk
   its completed pages go to ``sender.send``: posted as one-sided WRITEs into decode's pages once the
   destination is known, queued until then (the manager thread posts them when it arrives). On a
   DP-attention engine the request runs on the rank the router named (``PDRequest.dp_rank``), else on the
   engine's own pick;
3. after the last chunk, the first token goes to the client at once and the job moves to **inflight**: its
   pages stay held until the sender reports ``Success`` (every WRITE done) or ``Failed`` with no WRITE in
   flight; then the engine frees them and the stream ends with FINAL. A cancel (the router's, when the decode
   half failed) aborts an inflight room too: a decode that died before posting its destination leaves nothing
   else that would end it before the bootstrap timeout. A destination that never comes fails the
   room after ``bootstrap_timeout_s`` and frees the pages.

A failure anywhere (bootstrap timeout, decode cancelled or gone, client cancel (the router's too),
engine rejection) ends that request with an error response and FINAL, and nothing else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from bootstrap.messages import InstanceLoad
from kv_transfer import AuxData, BaseKVManager, BaseKVSender, KVPoll, TransferError
from serving.delta import ErrorKind, ResponseChunk
from serving.events import LoopEvent, RequestFailed
from serving.metrics import ServingMetrics
from serving.parsing.pd_request import PDRequest
from serving.stream import ResponseSink, client_message, error_kind_of
from serving.workers.engine_loop import EngineLoop, PagedEngineCore
from serving.workers.intake import Intake, WorkerTokenizer

logger = logging.getLogger(__name__)


class PrefillEngineCore(PagedEngineCore, Protocol):
    """The prefill half of ``engine.LLMEngine`` (mode ``prefill``) the worker drives, on the loop thread."""

    def release_request(self, request_id: str) -> None:
        """Free a finished request's pages (held after its last chunk while its KV is sent)."""
        ...


@dataclass
class _Job:
    request_id: str
    pd: PDRequest
    token_ids: list[int]
    sink: ResponseSink
    sender: BaseKVSender | None = None
    first_send_s: float | None = None
    last_send_s: float | None = None
    failed: str | None = None
    cumulative_logprob: float = 0.0


class PrefillWorker:
    """Runs prefill for rooms and sends their KV; one instance per Triton model instance."""

    def __init__(self, loop: EngineLoop, engine: PrefillEngineCore, tokenizer: WorkerTokenizer,
                 kv_manager: BaseKVManager, page_size: int, name: str = "prefill",
                 metrics: ServingMetrics | None = None) -> None:
        """Registers itself as a tick hook of ``loop``; starts nothing.

        Args:
            loop: the loop of ``engine`` (not started).
            engine: a prefill-mode engine (``loop.engine``); called on the loop thread only.
            tokenizer: the engine's tokenizer.
            kv_manager: a prefill-role ``kv_transfer.BaseKVManager`` (``create_sender``), not started.
            page_size: tokens per KV page of the engine.
            name: prefix of request ids and thread names.
            metrics: where to publish queue lengths and outcomes; None disables.
        """
        self._loop = loop
        self._engine = engine
        self._kv = kv_manager
        self._page_size = page_size
        self._name = name
        self._metrics = metrics
        self._intake: Intake[_Job] = Intake(loop, tokenizer, name)
        self._prefilling: dict[str, _Job] = {}
        self._inflight: dict[str, _Job] = {}
        self._transfer_s_total = 0.0
        self._transfer_tail_s_total = 0.0
        # snapshot taken every tick; read by the KV manager's heartbeat, and by its registration, which the
        # handle's start() sends before the loop's first tick: taken here too, so that a router's first
        # view of the instance has its pages and DP ranks (not an empty load until the next heartbeat)
        self.load = self._load()
        loop.add_hook(self)

    # ---- any thread ----------------------------------------------------------------------------------------
    def handle(self, pd: PDRequest, sink: ResponseSink) -> str:
        """Queue one request; responses go to ``sink``. Never raises: failures become an error response."""
        return self._intake.accept(pd, sink,
                                   lambda request_id, token_ids: _Job(request_id, pd, token_ids, sink))

    def num_active(self) -> int:
        return len(self._intake) + len(self._prefilling) + len(self._inflight)

    def fail_all(self, reason: str) -> None:
        """After the loop stopped: end every request still queued here with an error response (FINAL)."""
        jobs = self._intake.take() + [*self._prefilling.values(),
                                      *self._inflight.values()]
        self._prefilling, self._inflight = {}, {}
        for job in jobs:
            if job.sender is not None:
                job.sender.abort(reason)
            job.sink.send_error(reason)

    @property
    def transfer_seconds_total(self) -> float:
        """Sum over finished rooms of (first chunk posted → every WRITE done), seconds."""
        return self._transfer_s_total

    @property
    def transfer_tail_seconds_total(self) -> float:
        """Sum over finished rooms of (last chunk posted → every WRITE done), seconds: the part of the
        transfer that no prefill compute hides (the decode side's second token waits for it; the first token
        does not)."""
        return self._transfer_tail_s_total

    # ---- loop thread ---------------------------------------------------------------------------------------
    def on_tick(self) -> bool:
        """Advance every queue by one round; True while something waits on the network."""
        for job in self._intake.take():
            job.sender = self._kv.create_sender(job.pd.room)
            if job.sender.poll() == KVPoll.Failed:   # the room is open here already
                self._end_failed(job, _failure(job.sender, None))
            else:
                self._start_prefill(job)
        self._poll_prefilling()
        self._poll_inflight()
        self._publish()
        self.load = self._load()
        return bool(self._prefilling or self._inflight)

    def _load(self) -> InstanceLoad:
        """Queued: jobs not taken by the loop yet; running: prefilling (in the engine); queued prompt tokens:
        the prefilling jobs' prompts, and per DP-attention rank those of the jobs on that rank (the router's
        ``dp_rank``, else where the engine placed it)."""
        engine = self._engine
        rank_free = engine.rank_free_pages
        rank_queued = [0] * len(rank_free)
        for job in self._prefilling.values():
            rank = job.pd.dp_rank if job.pd.dp_rank is not None else engine.dp_rank_of(job.request_id)
            if rank is not None and rank < len(rank_queued):
                rank_queued[rank] += len(job.token_ids)
        return InstanceLoad(
            num_queued_requests=len(self._intake), num_running_requests=len(self._prefilling),
            num_queued_prompt_tokens=sum(len(j.token_ids) for j in self._prefilling.values()),
            num_free_pages=engine.num_free_pages, num_total_pages=engine.num_total_pages,
            page_size=self._page_size, rank_free_pages=rank_free, rank_queued_prompt_tokens=rank_queued)

    def _start_prefill(self, job: _Job) -> None:
        assert job.sender is not None
        num_pages = -(-len(job.token_ids) // self._page_size)
        try:
            # a partly filled last page: only its filled slots
            job.sender.init(num_pages, len(job.token_ids))
        except TransferError as e:
            self._end_failed(job, str(e))
            return
        self._prefilling[job.request_id] = job
        self._loop.submit(job.request_id, job.token_ids, job.pd.request.params,
                          lambda event: self._on_event(job, event), dp_rank=job.pd.dp_rank)

    def _poll_prefilling(self) -> None:
        for job in list(self._prefilling.values()):
            assert job.sender is not None
            reason = self._cancel_reason(job)
            if reason is None and job.sender.poll() == KVPoll.Failed:
                reason = _failure(job.sender, None)
            if reason is not None and job.failed is None:
                job.failed = reason
                job.sender.abort(reason)
                self._loop.abort(job.request_id, reason)  # → RequestFailed in _on_event

    def _on_event(self, job: _Job, event: LoopEvent) -> None:
        assert job.sender is not None
        if isinstance(event, RequestFailed):
            self._prefilling.pop(job.request_id, None)
            reason = job.failed or client_message(event.error)
            job.sender.abort(reason)
            # a rejection by the engine is the request's fault; a transfer failure (job.failed) is ours
            self._end_failed(job, reason, ErrorKind.INSTANCE if job.failed else error_kind_of(event.error))
            return
        chunk = event.prefill_chunk
        if chunk is None:
            return
        aux = None
        if chunk.is_last:
            assert chunk.first_token_id is not None and chunk.first_logprob is not None
            aux = AuxData(chunk.first_token_id, chunk.first_logprob, job.pd.room)
            # the first token goes to the client before the last pages' WRITE is posted (with inline progress
            # ``send`` copies them, ~1 ms of TTFT on the tiny model here); it travels with its logprobs
            # (decode reports only the tokens after it), and with the finish reason when it already ends the
            # request (EOS, a stop, max_tokens == 1). A transfer that fails later fails the request as before.
            job.cumulative_logprob = event.cumulative_logprob
            logprobs = tuple(event.new_token_logprobs) if job.pd.request.params.logprobs is not None else None
            job.sink.send(ResponseChunk.single(text=event.new_text, finish_reason=chunk.finish_reason,
                                               num_input_tokens=event.num_prompt_tokens, num_output_tokens=1,
                                               num_new_tokens=1, cumulative_logprob=event.cumulative_logprob,
                                               logprobs=logprobs, num_cached_tokens=event.num_cached_tokens,
                                               token_ids=tuple(event.new_token_ids)),
                          final=False)
        send_s = time.monotonic()   # before ``send``: with inline progress it posts (copies) the WRITE
        job.first_send_s = job.first_send_s or send_s
        job.sender.send(chunk.page_ids, chunk.is_last, aux)
        if chunk.is_last:
            job.last_send_s = send_s
            self._prefilling.pop(job.request_id, None)
            self._inflight[job.request_id] = job

    def _poll_inflight(self) -> None:
        for job in list(self._inflight.values()):
            assert job.sender is not None
            reason = self._cancel_reason(job)
            if reason is not None and job.failed is None and job.sender.poll() != KVPoll.Success:
                # the router cancelled after the first token: its decode half failed or went away (maybe
                # before it ever posted a destination, so no peer here can report it); the room ends now, not
                # at the bootstrap timeout, and its pages come back once no WRITE is in flight
                job.failed = reason
                job.sender.abort(reason)
            state = job.sender.poll()
            if state not in (KVPoll.Success, KVPoll.Failed) or not job.sender.pages_releasable():
                continue
            del self._inflight[job.request_id]
            self._engine.release_request(job.request_id)
            if state == KVPoll.Success:
                assert job.first_send_s is not None and job.last_send_s is not None
                now = time.monotonic()
                self._transfer_s_total += now - job.first_send_s
                self._transfer_tail_s_total += now - job.last_send_s
                job.sink.send(ResponseChunk.single(num_input_tokens=len(job.token_ids), num_output_tokens=1,
                                                   cumulative_logprob=job.cumulative_logprob),
                              final=True)
                self._count("finished", job)
            else:
                self._end_failed(job, _failure(job.sender, None))

    def _cancel_reason(self, job: _Job) -> str | None:
        if job.sink.is_cancelled():
            return "cancelled by the client"
        return None

    def _end_failed(self, job: _Job, reason: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        logger.info("request %s room=%d failed: %s", job.request_id, job.pd.room, reason)
        job.sink.send_error(reason, kind)
        self._count("failed", job)

    def _count(self, outcome: str, job: _Job) -> None:
        if self._metrics is not None:
            self._metrics.request_done(outcome, len(job.token_ids), 1 if outcome == "finished" else 0)

    def _publish(self) -> None:
        if self._metrics is None:
            return
        waiting = sum(1 for j in (*self._prefilling.values(), *self._inflight.values())
                      if j.sender is not None and j.sender.poll() == KVPoll.Bootstrapping)
        self._metrics.set_queue_length("bootstrap", waiting)   # rooms whose destination has not come yet
        self._metrics.set_queue_length("prefilling", len(self._prefilling))
        self._metrics.set_queue_length("inflight", len(self._inflight))


def _failure(sender: BaseKVSender, fallback: str | None) -> str:
    failure = sender.failure
    return str(failure) if failure is not None else (fallback or "KV transfer failed")
