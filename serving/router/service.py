"""``Router``: the whole router assembled and running on its own event loop thread; Triton-free.

``serving.router.triton_model`` (the ``pd_ensemble`` adapter) hands it requests from Triton's execute thread;
tests and benchmarks drive it in-process the same way.

Threads (owner ``Router``; started by ``start``, stopped by ``stop`` in reverse order):

=========================  ===================================================================================
``router-loop-<name>``     the asyncio loop: every orchestration, the gRPC child streams, the readiness
                           endpoint, the metrics publisher
``router-fleet-<name>``    ``FleetWatcher``: reads the members, asks each member's rendezvous for its load
``router-poll-<name>_*``   the watcher's pool: one member's rendezvous poll each
=========================  ===================================================================================

Drain (``drain``, a server stop): refuse new requests ("the router is draining"), report not ready, and let
the open ones run to their end (their orchestrations go on as usual: retries, migrations, a draining decode's
streams moved to another decode) up to a timeout.

Shutdown (``stop``): refuse new requests; cancel every orchestration (each ends its client stream with an
error and FINAL, and cancels its child streams: Triton tells each child, which aborts its room and frees its
pages); stop the fleet watcher; close the gRPC channels; stop the loop. A router that dies instead needs no
cleanup of its own: its connections drop, and Triton cancels its children the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from serving.delta import Delta
from serving.parsing.request import GenerateRequest
from serving.router.config import RouterConfig
from serving.router.discovery import LocalServerMembers, MemberSource
from serving.router.fleet import Fleet, FleetWatcher
from serving.router.launch import ChildLauncher, Launcher
from serving.router.metrics import RouterMetricsSink
from serving.router.orchestrator import PDOrchestrator, RoutedRequest
from serving.router.pairing import make_policy

logger = logging.getLogger(__name__)

METRICS_INTERVAL_S = 0.25


class TokenCounter:
    """The prompt's token ids (a list), with the fleet's tokenizer (chat template applied when asked): the
    workers' own ids, so the cache-aware policy's page keys are the engines'. Without a tokenizer (or when
    tokenizing fails), only an estimate of the count (an int): one token per 3 UTF-8 bytes. ``fingerprint``:
    the tokenizer's (``""`` without one): the ids go to the workers with it (``PDOrchestrator``)."""

    def __init__(self, model: str) -> None:
        self._tokenizer: Any = None
        self.fingerprint = ""
        if model:
            from engine.model.loader import load_tokenizer  # the engine's own loader: same ids as the workers

            self._tokenizer = load_tokenizer(model)
            self.fingerprint = self._tokenizer.fingerprint

    def __call__(self, request: GenerateRequest) -> list[int] | int:
        if self._tokenizer is not None:
            from serving.parsing.prompt import prompt_token_ids

            try:
                ids = prompt_token_ids(self._tokenizer, request)
                return ids if ids else 1
            except Exception:   # a template error is the workers' to report; pair by an estimate meanwhile
                logger.debug("prompt not tokenized; estimating its length", exc_info=True)
        return max(1, len(request.prompt.encode("utf-8")) // 3)


class Router:
    """Constructed without side effects; ``start`` brings it up, ``stop`` takes it down."""

    def __init__(self, config: RouterConfig, name: str, model_name: str = "pd_ensemble",
                 metrics: RouterMetricsSink | None = None, launcher: Launcher | None = None,
                 count_tokens: Callable[[GenerateRequest], list[int] | int] | None = None,
                 members: MemberSource | None = None) -> None:
        """
        Args:
            config: the router's knobs.
            name: the Triton instance name (thread names, logs).
            model_name: the model clients call.
            metrics: where to publish; None disables.
            launcher: how children are reached; default ``ChildLauncher`` (worker endpoints in child frames,
                tritonservers over gRPC).
            count_tokens: the prompt's token ids, or only their count; default
                ``TokenCounter(config.tokenizer)``.
            members: who the fleet is; default ``make_member_source(config)``.
        """
        self.config = config
        self._name = name
        self._metrics = metrics
        self.fleet = Fleet(config)
        self._watcher = FleetWatcher(self.fleet, config, members or make_member_source(config), name)
        self._launcher: Launcher = launcher or ChildLauncher(fleet_secret=config.fleet_secret,
                                                             grpc_tls=config.grpc_tls,
                                                             fleet_tls=config.fleet_tls)
        self._count_tokens = count_tokens
        self.orchestrator: PDOrchestrator | None = None
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._requests: set[asyncio.Task[None]] = set()   # the requests' tasks (loop thread)
        self._accepting = False
        self._draining = False
        self._health_runner: Any = None
        self._stop_lock = threading.Lock()

    def start(self, timeout_s: float = 30.0) -> None:
        """Load the tokenizer, read the fleet, start the loop thread (and the readiness endpoint when
        ``health_port`` is set). Raises RuntimeError when the loop does not come up in time."""
        count = self._count_tokens or TokenCounter(self.config.tokenizer)
        self.orchestrator = PDOrchestrator(self.config, self.fleet, make_policy(self.config.policy,
                                           self.config.direct_decode_max_tokens), self._launcher,
                                           count, self._metrics,
                                           tokenizer_id=count.fingerprint
                                           if isinstance(count, TokenCounter) else "")
        self._watcher.start()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"router-loop-{self._name}",
                                        daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_async(), self._loop).result(timeout_s)
        self._accepting = True
        logger.info("router %s up: policy=%s fleet=%s", self._name, self.config.policy,
                    self.fleet.health())

    async def _start_async(self) -> None:
        self._spawn(self._publish_metrics())
        if self.config.health_port:
            from aiohttp import web

            app = web.Application()
            app.add_routes([web.get("/ready", self._ready_handler), web.get("/health", self._live_handler)])
            self._health_runner = web.AppRunner(app, access_log=None)
            await self._health_runner.setup()
            await web.TCPSite(self._health_runner, "0.0.0.0", self.config.health_port).start()

    def submit(self, routed: RoutedRequest, emit: Callable[[Delta], None],
               is_cancelled: Callable[[], bool]) -> None:
        """Start one request (any thread); ``emit`` gets its chunks on the loop thread, the final one exactly
        once (also when the router stops meanwhile). Raises RuntimeError when the router is not running."""
        if not self._accepting:
            raise RuntimeError("the router is not running")
        self._loop.call_soon_threadsafe(self._start_request, routed, FinalOnce(emit), is_cancelled)

    def ready(self) -> bool:
        """True while at least one prefill and one decode instance are in rotation and the router is not
        draining."""
        return self.fleet.ready() and not self._draining

    @property
    def num_requests(self) -> int:
        """Requests being served now (any thread: a reading of the loop thread's set)."""
        return len(self._requests)

    def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Stop admitting (a new request ends at once with "the router is draining"; readiness turns false)
        and wait up to ``timeout_s`` seconds for the requests in flight to end by themselves; returns how many
        are still running (``stop`` ends them). Any thread but the loop's; idempotent."""
        if not self._draining:
            self._draining = True
            logger.info("router %s draining: %d requests in flight", self._name, self.num_requests)
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        return self.num_requests

    def stop(self, timeout_s: float = 15.0) -> None:
        """Idempotent and thread-safe; see the module docstring for the order."""
        with self._stop_lock:
            self._stop_locked(timeout_s)

    def _stop_locked(self, timeout_s: float) -> None:
        if self._thread is None:
            return
        self._accepting = False
        began = time.monotonic()
        try:
            asyncio.run_coroutine_threadsafe(self._stop_async(timeout_s), self._loop).result(timeout_s + 5)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.error("router %s: in-flight requests did not end within %.0f s", self._name, timeout_s)
        tasks_s = time.monotonic() - began
        self._watcher.stop(timeout_s)
        watcher_s = time.monotonic() - began - tasks_s
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._thread = None
        logger.info("router %s stopped in %.2f s (requests and channels %.2f s, fleet watcher %.2f s)",
                    self._name, time.monotonic() - began, tasks_s, watcher_s)

    async def _stop_async(self, timeout_s: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
            # where a task that ignores its cancel waits (a stop must never wait on one)
            for task in pending:
                stack = io.StringIO()
                task.print_stack(file=stack)
                logger.error("router %s: task still running %.0f s after its cancel: %s", self._name,
                             timeout_s, stack.getvalue())
        if self._health_runner is not None:
            await self._health_runner.cleanup()
        await self._launcher.close()

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_request(self, routed: RoutedRequest, emit: FinalOnce,
                       is_cancelled: Callable[[], bool]) -> None:
        """Loop thread. A request that arrives as the router stops, or whose task is cancelled before it ever
        ran (its ``_serve`` then never starts, so its ``except`` never runs), still gets its final chunk: the
        client's stream must end with FINAL, and tritonserver does not finish unloading the model while a
        decoupled request's stream is open (a stop under load took the whole 20 s exit timeout)."""
        if not self._accepting:
            emit.fail("the router is shutting down")
            return
        if self._draining:
            emit.fail("the router is draining (its server is stopping): send the request to another router")
            return
        task = self._spawn(self._serve(routed, emit, is_cancelled))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)
        task.add_done_callback(lambda _: emit.fail("the router is shutting down"))

    async def _serve(self, routed: RoutedRequest, emit: Callable[[Delta], None],
                     is_cancelled: Callable[[], bool]) -> None:
        assert self.orchestrator is not None
        try:
            await self.orchestrator.generate(routed, emit, is_cancelled)
        except asyncio.CancelledError:
            emit(Delta.failure("the router is shutting down"))

    async def _publish_metrics(self) -> None:
        while True:
            if self._metrics is not None and self.orchestrator is not None:
                admission = self.orchestrator.admission
                self._metrics.publish_queue(admission.queued, admission.inflight)
                self._metrics.publish_health(self.fleet.health(), self.ready())
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def _ready_handler(self, request: Any) -> Any:
        from aiohttp import web

        body = {"ready": self.ready(), "draining": self._draining, "router": self._name,
                "instances": self.fleet.health()}
        return web.Response(text=json.dumps(body), status=200 if body["ready"] else 503,
                            content_type="application/json")

    async def _live_handler(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="ok")


class FinalOnce:
    """An ``emit`` that passes chunks on until the final one and drops anything after it; ``fail`` sends an
    error final unless a final went out already. Loop thread only."""

    def __init__(self, emit: Callable[[Delta], None]) -> None:
        self._emit = emit
        self.done = False

    def __call__(self, chunk: Delta) -> None:
        if self.done:
            return
        self.done = chunk.final
        self._emit(chunk)

    def fail(self, reason: str) -> None:
        if not self.done:
            self(Delta.failure(reason))


def make_member_source(config: RouterConfig) -> MemberSource:
    """The fleet's members: the membership registry at ``config.registry_url`` when one is set, else the PD
    models of this router's own tritonserver (``config.grpc_url``)."""
    if config.registry_url:
        from serving.router.registry_members import RegistryMembers

        return RegistryMembers(config.registry_url, config.fleet_secret, tls=config.fleet_tls,
                               etcd_settings=config.etcd_settings)
    return LocalServerMembers(config.grpc_url, fleet_secret=config.fleet_secret, tls=config.grpc_tls)
