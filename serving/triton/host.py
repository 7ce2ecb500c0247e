"""``ModelHost``: the lifecycle every python-backend model of this project shares (colocated, prefill, decode,
the router), so that each adapter says only what is its own: how to start its service, stop it, and answer one
request.

initialize (Triton's model-load thread): logging (INFO into the server log; ``kill -USR1 <stub pid>`` dumps
every thread's stack there), the decoupled transaction policy checked, the instance's custom metrics, its
response thread (``ResponseDispatcher``: the engine loops and the router never wait on Triton), then the
adapter's ``start``, then three watches: ``OrphanWatch`` (the parent tritonserver vanished), ``ServerShutdownWatch``
(a server stop ends the requests in flight at once: tritonserver waits for them before ``finalize``; calls
``on_server_stop``) and ``StubGuard`` (a dead stub gets its server replaced: docs/healing.md).

execute (Triton's execute thread): ``answer_each`` hands each request to the adapter's ``handle``; a bad input
gets one error response with FINAL.

finalize (Triton's unload): the watches first (this stub's end is no death to heal), then the adapter's
``drain`` (requests that reached it past tritonserver run to their end, as tritonserver's own did), then its
``stop`` (requests in flight end with an error and FINAL), then the response thread once it has sent them,
then the custom metrics (a metric outliving ``finalize`` segfaults the stub's teardown), then the SIGUSR1
handler (a finalizing stub must not dump its heap).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import time
from abc import ABC, abstractmethod
from typing import Any

from serving.config import read_grpc_tls
from serving.metrics import ServingMetrics
from serving.triton.orphan_watch import OrphanWatch
from serving.triton.response_dispatch import ResponseDispatcher
from serving.triton.server_watch import ServerShutdownWatch
from serving.triton.stub_guard import StubGuard
from serving.triton.io import TritonResponseSink, answer_each, new_dispatcher, pb_utils

logger = logging.getLogger(__name__)


def setup_logging() -> None:
    """INFO logs to the server log; ``kill -USR1 <stub pid>`` dumps every Python thread's stack there too, and so
    does a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: ``faulthandler.enable``) before the stub dies, so
    that a stub lost while loading or serving names where it was."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def teardown_logging() -> None:
    """``finalize``: the dump handlers go with the model (a stub must not dump a finalizing heap)."""
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.disable()


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
    #: How long ``finalize`` lets requests that tritonserver does not see (``drain``) run to their end, seconds.
    DRAIN_TIMEOUT_S = 120.0
    #: True for the router's children (prefill, decode): requests are answered with the child codec's outputs
    #: (``answer_each(child=True)``); False: with the client outputs, each request timed in ``metrics``.
    ANSWER_CHILD = False

    model_name: str
    instance_name: str
    metrics: ServingMetrics
    responses: ResponseDispatcher

    def initialize(self, args: dict[str, Any]) -> None:
        setup_logging()
        self.model_name, self.instance_name = str(args["model_name"]), str(args["model_instance_name"])
        model_config = decoupled_config(args, self.model_name)
        self.metrics = ServingMetrics(pb_utils().MetricFamily, model=self.model_name, instance=self.instance_name)
        self.responses = new_dispatcher(self.instance_name)
        self.responses.start()
        try:
            self._grpc_tls = read_grpc_tls()
            grpc_url = self.start(args, model_config)
        except BaseException:   # a failed load: nothing of this instance may outlive it (no finalize follows)
            self.responses.stop(self.STOP_TIMEOUT_S)
            self.metrics.close()
            teardown_logging()
            raise
        self._orphan_watch = OrphanWatch(self.instance_name).start()
        self._server_watch = ServerShutdownWatch(self.instance_name, grpc_url, self.on_server_stop,
                                                 tls=self._grpc_tls).start()
        self._stub_guard = StubGuard(self.model_name, grpc_url, self._grpc_tls).start()

    def execute(self, requests: list[Any]) -> None:
        if self.ANSWER_CHILD:
            answer_each(requests, self.handle, self.responses, child=True)
        else:
            answer_each(requests, self.handle, self.responses, timing=self.metrics)

    def finalize(self) -> None:
        began = time.monotonic()
        self._stub_guard.stop()   # first: this stub's end is no death to heal
        self._server_watch.stop()
        self._orphan_watch.stop()
        self.drain(self.DRAIN_TIMEOUT_S)   # an unload: tritonserver waited for its requests, this waits for ours
        self.stop(self.STOP_TIMEOUT_S)
        self.responses.stop(self.STOP_TIMEOUT_S)   # after the service: the FINALs of its requests go out first
        self.metrics.close()   # after every thread that updates them stopped; before the stub tears down
        logger.info("%s finalized in %.2f s", self.instance_name, time.monotonic() - began)
        teardown_logging()

    def on_server_stop(self) -> None:
        """The server is stopping (``ServerShutdownWatch``'s thread): end every request now."""
        self.stop(self.STOP_TIMEOUT_S)

    @abstractmethod
    def start(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        """Build and start the service from the model's ``parameters``; returns the gRPC URL of this
        tritonserver (what the watches ask). Raises ConfigError (or another error) to fail the load."""

    def drain(self, timeout_s: float) -> None:
        """``finalize`` (Triton's unload thread), before ``stop``: let requests that did not come through
        tritonserver (which waits for its own before ``finalize``) end by themselves, up to ``timeout_s``
        seconds, refusing new ones. Default: none to wait for. After a server stop (``on_server_stop``) there
        is nothing left to wait for."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """End every request in flight with an error and FINAL, and stop the service; any thread, more than
        once."""

    @abstractmethod
    def handle(self, request: Any, sink: TritonResponseSink) -> None:
        """Answer one request through ``sink`` (Triton's execute thread; must not block on the engine)."""
