"""``DecodeWorker``: the decode half of PD disaggregation, on one engine in decode mode.

Lifecycle of one request (SGLang's decode side), every step but the first on the engine loop thread:

1. ``handle`` (Triton's execute thread): tokenize (or take the router's ids: ``Intake``); the job joins the
   **prealloc queue**;
2. prealloc (FIFO): a KV receiver for the room (handshake with the prefill instance, once per peer), then the
   engine reserves pages for prompt + max_tokens (a request that waits for free pages holds up the ones behind
   it; one that can never fit fails), sharing the prompt's longest prefix its prefix cache holds, and
   ``receiver.init`` tells the prefill instance where to write and how many leading tokens decode already has
   (prefill sends only the pages after them). On a DP-attention engine the pages are the pool's of the rank
   the router named (``PDRequest.dp_rank``; else the engine's own pick), so the KV lands in that rank's pool;
3. **transfer queue**: the receiver is polled each tick; at ``Success`` the request joins the **running
   batch** with ``add_prebuilt_request`` (first token from the aux data, no prefill forward) and streams its
   tokens;
4. a failure ends the request with an error response; its pages stay reserved until the receiver says no
   write can land any more (``pages_releasable``), then the engine frees them.

Client cancel (Triton's cancellation: the router cancelled its child stream, or its connection dropped) is
checked every tick in every queue.

**Direct decode** (a request without ``prefill_instance``): no room handshake and no transfer; the job goes
straight to the engine (``EngineLoop.submit``), which prefills the prompt in this instance and streams every
token, as the colocated engine does. The router sends short prompts this way (``direct_decode_max_tokens``),
and migrated requests (``resume_token_ids``: the engine prefills the prompt with the tokens already sent and
streams only the ones after them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from bootstrap.messages import InstanceLoad
from engine.errors import OutOfPages, RequestRejected
from engine.outputs import Reservation
from engine.sampling_params import SamplingParams
from kv_transfer import BaseKVManager, BaseKVReceiver, KVPoll
from serving.delta import ErrorKind
from serving.events import LoopEvent
from serving.metrics import ServingMetrics
from serving.parsing.pd_request import PDRequest
from serving.stream import GenerationStream, ResponseSink, client_message
from serving.workers.engine_loop import EngineLoop, PagedEngineCore
from serving.workers.intake import Intake, WorkerTokenizer

logger = logging.getLogger(__name__)


class DecodeEngineCore(PagedEngineCore, Protocol):
    """The decode half of ``engine.LLMEngine`` (mode ``decode``) the worker drives, on the loop thread."""

    def reserve_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        dp_rank: int | None = None) -> Reservation: ...

    def add_prebuilt_request(self, request_id: str, first_token_id: int, first_logprob: float,
                             first_token_sent: bool = False) -> None: ...


@dataclass
class _Job:
    request_id: str
    pd: PDRequest
    token_ids: list[int]
    stream: GenerationStream
    receiver: BaseKVReceiver | None = None
    reserved: bool = False
    abort_reason: str | None = field(default=None)


class DecodeWorker:
    """Receives KV for rooms and decodes them in one continuous batch."""

    def __init__(self, loop: EngineLoop, engine: DecodeEngineCore, tokenizer: WorkerTokenizer,
                 kv_manager: BaseKVManager, name: str = "decode", metrics: ServingMetrics | None = None,
                 page_size: int = 16) -> None:
        """Registers itself as a tick hook of ``loop``; starts nothing.

        Args:
            loop: the loop of ``engine`` (not started).
            engine: a decode-mode engine (``loop.engine``); called on the loop thread only.
            tokenizer: the engine's tokenizer.
            kv_manager: a decode-role ``kv_transfer.BaseKVManager`` (``create_receiver``), not started.
            name: prefix of request ids.
            metrics: where to publish queue lengths and outcomes; None disables.
            page_size: tokens per KV page of the engine (for the reported load).
        """
        self._loop = loop
        self._engine = engine
        self._kv = kv_manager
        self._name = name
        self._metrics = metrics
        self._intake: Intake[_Job] = Intake(loop, tokenizer, name)
        self._prealloc: list[_Job] = []
        self._transfer: dict[str, _Job] = {}
        self._running: dict[str, _Job] = {}
        self._releasing: dict[str, _Job] = {}  # failed; pages held until no write can land
        self._page_size = page_size
        # snapshot taken every tick; read by the KV manager's heartbeat, and by its registration, which the
        # handle's start() sends before the loop's first tick: taken here too, so that a router's first
        # view of the instance has its pages and DP ranks (not an empty load until the next heartbeat)
        self.load = self._load()
        loop.add_hook(self)

    # ---- any thread ----------------------------------------------------------------------------------------
    def handle(self, pd: PDRequest, sink: ResponseSink) -> str:
        """Queue one request; its tokens after the first go to ``sink``. Never raises."""
        return self._intake.accept(pd, sink, lambda request_id, token_ids: _Job(
            request_id, pd, token_ids, GenerationStream(request_id, pd.request, sink)))

    def num_active(self) -> int:
        return (len(self._intake) + len(self._prealloc) + len(self._transfer) + len(self._running)
                + len(self._releasing))

    def fail_all(self, reason: str) -> None:
        """After the loop stopped: end every request still queued here with an error response (FINAL)."""
        jobs = self._intake.take() + self._prealloc + list(self._transfer.values())
        self._prealloc, self._transfer = [], {}
        for job in jobs:
            if job.receiver is not None:
                job.receiver.abort(reason)
            job.stream.sink.send_error(reason)

    # ---- loop thread ---------------------------------------------------------------------------------------
    def on_tick(self) -> bool:
        """Advance every queue by one round; True while something waits on the network."""
        for job in self._intake.take():
            if job.pd.direct:
                self._start_direct(job)
                continue
            job.receiver = self._kv.create_receiver(job.pd.room, job.pd.prefill_instance,
                                                    job.pd.prefill_rendezvous)
            self._prealloc.append(job)
        self._poll_prealloc()
        self._poll_transfer()
        self._poll_running()
        self._poll_releasing()
        self._publish()
        self.load = self._load()
        return bool(self._prealloc or self._transfer or self._releasing)

    def _load(self) -> InstanceLoad:
        """Free pages net of what the prealloc queue will reserve (decode reserves prompt + max_tokens);
        queued prompt tokens: the prealloc queue's. Per DP-attention rank the same, of the jobs the router
        sent to that rank (``dp_rank``; a job without one has no rank until its pages are reserved)."""
        ps = self._page_size
        rank_free = list(self._engine.rank_free_pages)
        rank_queued = [0] * len(rank_free)
        promised = 0
        for job in self._prealloc:
            pages = -(-(len(job.token_ids) + job.pd.request.params.max_tokens - 1) // ps)
            promised += pages
            rank = job.pd.dp_rank
            if rank is not None and rank < len(rank_free):
                rank_free[rank] = max(0, rank_free[rank] - pages)
                rank_queued[rank] += len(job.token_ids)
        return InstanceLoad(
            num_queued_requests=len(self._prealloc) + len(self._transfer) + len(self._intake),
            num_running_requests=len(self._running),
            num_queued_prompt_tokens=sum(len(j.token_ids) for j in self._prealloc),
            num_free_pages=max(0, self._engine.num_free_pages - promised),
            num_total_pages=self._engine.num_total_pages, page_size=ps,
            rank_free_pages=rank_free, rank_queued_prompt_tokens=rank_queued)

    def _start_direct(self, job: _Job) -> None:
        """Direct decode: the engine prefills and decodes the request like a colocated one."""
        self._running[job.request_id] = job
        self._loop.submit(job.request_id, job.token_ids, job.pd.request.params,
                          lambda event: self._on_event(job, event), job.pd.resume_token_ids, job.pd.dp_rank)

    def _poll_prealloc(self) -> None:
        blocked = False
        for job in list(self._prealloc):
            assert job.receiver is not None
            reason = self._cancel_reason(job)
            if reason is None and job.receiver.poll() == KVPoll.Failed:
                reason = str(job.receiver.failure or "KV receiver failed")
            if reason is not None:
                self._prealloc.remove(job)
                self._fail(job, reason)
                continue
            if blocked:
                continue
            try:
                # the router's rank, when it chose one: the KV lands in that rank's pool (the reservation's
                # page ids are that rank's, rank * num_pages + p)
                reservation = self._engine.reserve_request(job.request_id, job.token_ids,
                                                           job.pd.request.params, job.pd.dp_rank)
            except OutOfPages:
                blocked = True  # FIFO: later requests wait behind the head
                continue
            except RequestRejected as e:
                self._prealloc.remove(job)
                self._fail(job, client_message(e), ErrorKind.REQUEST)
                continue
            except Exception as e:   # an engine fault on this request only: never stall the other queues
                logger.exception("request %s: reserving its pages failed", job.request_id)
                self._prealloc.remove(job)
                self._fail(job, f"decode could not reserve the request's pages: {e}")
                continue
            job.reserved = True
            # pages of the prompt's cached prefix are decode's own: prefill sends only the rest
            job.receiver.init(reservation.dst_page_ids, reservation.num_cached_tokens)
            self._prealloc.remove(job)
            self._transfer[job.request_id] = job

    def _poll_transfer(self) -> None:
        for job in list(self._transfer.values()):
            assert job.receiver is not None
            reason = self._cancel_reason(job)
            state = job.receiver.poll()
            if reason is None and state == KVPoll.Failed:
                reason = str(job.receiver.failure or "KV receiver failed")
            if reason is not None:
                del self._transfer[job.request_id]
                self._fail(job, reason)
            elif state == KVPoll.Success:
                del self._transfer[job.request_id]
                self._start_decode(job)

    def _start_decode(self, job: _Job) -> None:
        assert job.receiver is not None and job.receiver.aux is not None
        aux = job.receiver.aux
        self._engine.add_prebuilt_request(job.request_id, aux.first_token_id, aux.first_logprob,
                                          first_token_sent=True)
        self._running[job.request_id] = job
        self._loop.track(job.request_id, lambda event: self._on_event(job, event))

    def _on_event(self, job: _Job, event: LoopEvent) -> None:
        if job.stream.on_event(event):
            self._running.pop(job.request_id, None)
            outcome = "cancelled" if job.stream.cancelled else ("failed" if job.stream.error else "finished")
            self._count(outcome, job)

    def _poll_running(self) -> None:
        for job in list(self._running.values()):
            reason = self._cancel_reason(job)
            if reason is not None and not job.stream.cancelled:
                job.stream.cancelled = job.stream.sink.is_cancelled()
                self._loop.abort(job.request_id, reason)  # → RequestFailed → _on_event ends the stream

    def _poll_releasing(self) -> None:
        for job in list(self._releasing.values()):
            assert job.receiver is not None
            if job.receiver.pages_releasable():
                del self._releasing[job.request_id]
                self._engine.abort_request(job.request_id)

    def _fail(self, job: _Job, reason: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        """End the client stream now; free the pages once no late WRITE can land in them."""
        assert job.receiver is not None
        if job.receiver.poll() != KVPoll.Failed:
            job.receiver.abort(reason)
        if job.reserved:
            self._releasing[job.request_id] = job
        logger.info("request %s room=%d failed: %s", job.request_id, job.pd.room, reason)
        job.stream.sink.send_error(reason, kind)
        self._count("failed", job)

    def _cancel_reason(self, job: _Job) -> str | None:
        if job.stream.sink.is_cancelled():
            return "cancelled by the client"
        return None

    def _count(self, outcome: str, job: _Job) -> None:
        if self._metrics is not None:
            # a migrated request's resumed tokens were generated (and counted) where it came from
            generated = max(0, job.stream.num_output_tokens - len(job.pd.resume_token_ids))
            self._metrics.request_done(outcome, len(job.token_ids), generated)

    def _publish(self) -> None:
        if self._metrics is None:
            return
        self._metrics.set_queue_length("prealloc", len(self._prealloc))
        self._metrics.set_queue_length("transfer", len(self._transfer))
        self._metrics.set_queue_length("releasing", len(self._releasing))
