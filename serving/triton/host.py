"""``ModelHost``: the lifecycle every python-backend model of this project shares (colocated, prefill, decode,
the router), so that each adapter says only what is its own: how to start its service, drain it, stop it, and
answer one request.

initialize (Triton's model-load thread): logging (INFO into the server log; ``kill -USR1 <stub pid>`` dumps
every thread's stack there), the decoupled transaction policy checked, the instance's custom metrics, its
response thread (``ResponseDispatcher``: the engine loops and the router never wait on Triton), then the
adapter's ``start``, then the watches: ``OrphanWatch`` (the parent tritonserver vanished),
``ServerShutdownWatch`` (a server stop: calls ``on_server_stop``), and ``StubGuard`` armed (a dead stub gets
its server replaced: docs/healing.md). The stub's guardian process itself starts before everything else
(``serving.triton.entry``): while the model loads it already ends this stub at once should tritonserver die.

A server stop (SIGTERM, Ctrl-C: docs/healing.md "Stops"): tritonserver's readiness turns false and its models
take no new request; ``on_server_stop`` (the server watch's thread) then **drains**: the adapter's ``drain``
refuses new work (a PD worker leaves the fleet: listed draining, so routers stop pairing it and move a
decode's streams elsewhere; the router admits nothing more) and lets what is in flight run to its end, up to
``drain_timeout_s`` seconds from the moment the stop was seen; then ``stop`` ends what is left with an error
and FINAL, so that tritonserver can unload the model and exit within its exit timeout.

An unload that tritonserver does not finalize at once (it waits for the model's requests through it, or it
keeps holding the model): the server watch sees the model not ready and calls ``on_model_unloaded``, which
drains and stops the same way (docs/healing.md, "Unloads").

execute (Triton's execute thread): ``answer_each`` hands each request to the adapter's ``handle``; a bad input
gets one error response with FINAL.

finalize (Triton's unload; after a server stop, once the model's own requests ended): the stub guard told
first (this stub's end is no death to heal), then the server watch (a drain it runs is waited for), then the
adapter's ``drain`` (requests that reached it past tritonserver run to their end, as tritonserver's own did,
within the same deadline), then its ``stop`` (requests in flight end with an error and FINAL), then the
response thread once it has sent them, then the custom metrics (a metric outliving ``finalize`` segfaults the
stub's teardown), then the guardian reaped and the orphan watch stopped (last: a server that dies while this
stub drains still ends it at once), then the SIGUSR1 handler (a finalizing stub must not dump its heap).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from serving.config import DEFAULT_DRAIN_TIMEOUT_S, read_grpc_tls
from serving.metrics import ServingMetrics
from serving.triton.io import TritonResponseSink, answer_each, new_dispatcher, pb_utils
from serving.triton.orphan_watch import OrphanWatch
from serving.triton.response_dispatch import ResponseDispatcher
from serving.triton.server_watch import ServerShutdownWatch
from serving.triton.stub_guard import StubGuard

logger = logging.getLogger(__name__)


def setup_logging() -> None:
    """INFO logs to the server log; ``kill -USR1 <stub pid>`` dumps every Python thread's stack there too, and
    so does a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: ``faulthandler.enable``) before the stub
    dies, so that a stub lost while loading or serving names where it was."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def teardown_logging() -> None:
    """``finalize``: the dump handlers go with the model (a stub must not dump a finalizing heap)."""
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.disable()


def wait_idle(in_flight: Callable[[], int], timeout_s: float, poll_s: float = 0.05) -> int:
    """Poll ``in_flight()`` (any thread) every ``poll_s`` seconds until it reads 0 or ``timeout_s`` seconds
    passed; returns its last reading."""
    deadline = time.monotonic() + timeout_s
    left = in_flight()
    while left and time.monotonic() < deadline:
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        left = in_flight()
    return left


def decoupled_config(args: dict[str, Any], model: str) -> dict[str, Any]:
    """The model's config (``args["model_config"]``, JSON) as a dict.

    Raises:
        TritonModelException: the model does not use the decoupled transaction policy.
    """
    model_config = json.loads(args["model_config"])
    if not pb_utils().using_decoupled_model_transaction_policy(model_config):
        raise pb_utils().TritonModelException(f"{model} must use the decoupled transaction policy")
    return model_config


class ModelHost(ABC):
    """Base of the four Triton adapters (``TritonPythonModel`` behind each ``model.py``, through
    ``serving.triton.entry.deferred_model``). Subclasses implement ``start``, ``stop`` and ``handle``.

    Attributes (set in ``initialize``, before ``start``):
        model_name: the model's name in the repository.
        instance_name: Triton's name of this instance (``<model>_0_0``).
        metrics: the instance's custom metrics.
        responses: the instance's response thread.
    """

    #: How long ``stop`` and the response thread may take at ``finalize``, seconds.
    STOP_TIMEOUT_S = 30.0
    #: True for the router's children (prefill, decode): requests are answered with the child codec's outputs
    #: (``answer_each(child=True)``); False: with the client outputs, each request timed in ``metrics``.
    ANSWER_CHILD = False

    model_name: str
    instance_name: str
    metrics: ServingMetrics
    responses: ResponseDispatcher
    #: How long a stop lets the requests in flight run to their end, seconds: the model's ``drain_timeout_s``
    #: parameter, which ``start`` sets (``PD_DRAIN_TIMEOUT_S`` overrides it).
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    _drain_until_s: float | None = None

    def initialize(self, args: dict[str, Any]) -> None:
        self._drain_lock = threading.Lock()
        setup_logging()
        self.model_name, self.instance_name = str(args["model_name"]), str(args["model_instance_name"])
        # first: while the model loads its guardian already watches tritonserver (``serving.triton.entry``
        # starts it before the heavy imports and hands it over as ``stub_guard``)
        self._stub_guard = getattr(self, "stub_guard", None) or StubGuard(self.model_name).start()
        try:
            model_config = decoupled_config(args, self.model_name)
        except BaseException:
            self._stub_guard.stop()
            raise
        self.metrics = ServingMetrics(pb_utils().MetricFamily, model=self.model_name,
                                      instance=self.instance_name)
        self.responses = new_dispatcher(self.instance_name)
        self.responses.start()
        try:
            self._grpc_tls = read_grpc_tls()
            grpc_url = self.start(args, model_config)
        except BaseException:   # a failed load: nothing of this instance may outlive it (no finalize follows)
            self.responses.stop(self.STOP_TIMEOUT_S)
            self.metrics.close()
            self._stub_guard.stop()
            teardown_logging()
            raise
        self._orphan_watch = OrphanWatch(self.instance_name).start()
        self._server_watch = ServerShutdownWatch(self.instance_name, grpc_url, self.on_server_stop,
                                                 tls=self._grpc_tls, model=self.model_name,
                                                 on_unload=self.on_model_unloaded).start()
        self._stub_guard.arm(grpc_url, self._grpc_tls, self.drain_timeout_s)

    def execute(self, requests: list[Any]) -> None:
        if self.ANSWER_CHILD:
            answer_each(requests, self.handle, self.responses, child=True)
        else:
            answer_each(requests, self.handle, self.responses, timing=self.metrics)

    def finalize(self) -> None:
        began = time.monotonic()
        self._stub_guard.ending()   # first: this stub's end is no death to heal
        # a drain the watch runs (a server stop) is part of this finalize: waited for, within its deadline
        self._server_watch.stop(self.drain_left_s() + self.STOP_TIMEOUT_S + 5.0)
        left = self.drain(self.drain_left_s())   # tritonserver waited for its own requests, this for ours
        if left:
            logger.warning("%s: %d requests still in flight after the drain: ending them", self.instance_name,
                           left)
        self.stop(self.STOP_TIMEOUT_S)
        # after the service: the FINALs of its requests go out first
        self.responses.stop(self.STOP_TIMEOUT_S)
        self.metrics.close()   # after every thread that updates them stopped; before the stub tears down
        self._stub_guard.stop()
        self._orphan_watch.stop()   # last: no Python of ours may run while the stub tears down
        logger.info("%s finalized in %.2f s", self.instance_name, time.monotonic() - began)
        teardown_logging()

    def drain_left_s(self) -> float:
        """Seconds left of this instance's drain: its deadline is set by the first call (a server stop seen,
        or ``finalize``), ``drain_timeout_s`` from then. Any thread."""
        with self._drain_lock:
            if self._drain_until_s is None:
                self._drain_until_s = time.monotonic() + self.drain_timeout_s
            return max(0.0, self._drain_until_s - time.monotonic())

    def on_server_stop(self) -> None:
        """The server is stopping (``ServerShutdownWatch``'s thread; tritonserver takes no new request for
        this model any more): drain (what is in flight runs to its end, up to ``drain_timeout_s``), then end
        what is left."""
        began = time.monotonic()
        left = self.drain(self.drain_left_s())
        logger.info("%s: server stopping: drained in %.2f s (%d requests left to end with an error)",
                    self.instance_name, time.monotonic() - began, left)
        self.stop(self.STOP_TIMEOUT_S)

    def on_model_unloaded(self) -> None:
        """tritonserver reports this model not ready while the server stays live and this instance was not
        finalized (``ServerShutdownWatch``'s thread): an unload is under way. Drain and stop as for a server
        stop, so the unload takes effect within ``drain_timeout_s`` even when tritonserver keeps holding the
        model (docs/healing.md, "Unloads"); ``finalize``, when it comes, finds the service stopped."""
        began = time.monotonic()
        left = self.drain(self.drain_left_s())
        self.stop(self.STOP_TIMEOUT_S)
        logger.warning("%s: %s unloaded: drained in %.2f s (%d requests ended with an error) and stopped "
                       "serving; the stub exits when tritonserver finalizes the model", self.instance_name,
                       self.model_name, time.monotonic() - began, left)

    @abstractmethod
    def start(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        """Build and start the service from the model's ``parameters``; returns the gRPC URL of this
        tritonserver (what the watches ask). Raises ConfigError (or another error) to fail the load."""

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests and let those in flight end by themselves, up to ``timeout_s`` seconds; returns
        how many are still in flight (``stop`` ends them next). Called by ``on_server_stop`` (the server
        watch's thread) and by ``finalize`` (Triton's unload thread; tritonserver has waited for its own
        requests then, so what is left came past it, through a worker's own endpoint); both may run at once,
        and a second call must wait the same way. Default: nothing to wait for."""
        return 0

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """End every request in flight with an error and FINAL, and stop the service; any thread, more than
        once."""

    @abstractmethod
    def handle(self, request: Any, sink: TritonResponseSink) -> None:
        """Answer one request through ``sink`` (Triton's execute thread; must not block on the engine)."""
