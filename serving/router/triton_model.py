"""Triton python-backend adapter of the router (``model_repository/pd_ensemble``, decoupled).

initialize: parameters → ``RouterConfig`` (an unknown key or a bad value fails the load, naming it) → a started
``Router`` (its own event loop thread) and the instance's response thread. execute: parse each request (a bad
input gets one error response with FINAL) and hand it to the router; nothing blocks Triton's thread.
finalize: stop the router (requests in flight end with an error and FINAL; their child streams are cancelled,
so the workers drop their rooms), then the response thread once it has sent those FINALs, then the custom
metrics.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from serving.metrics import ServingMetrics
from serving.orphan_watch import OrphanWatch
from serving.parallel_sampling import SampleFanIn
from serving.router.config import build_router_config
from serving.router.metrics import RouterMetricsSink
from serving.router.orchestrator import RoutedRequest
from serving.router.responder import EnsembleResponder
from serving.router.service import Router
from serving.server_watch import ServerShutdownWatch
from serving.stub_guard import StubGuard
from serving.stream import ResponseSink
from serving.triton_io import TritonResponseSink, answer_each, new_dispatcher, parse_client_request, pb_utils
from serving.triton_pd import decoupled_config, setup_logging, teardown_logging

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0


class RouterModel:
    """``pd_ensemble``: the PD router."""

    def initialize(self, args: dict[str, Any]) -> None:
        setup_logging()
        model_name, instance = str(args["model_name"]), str(args["model_instance_name"])
        model_config = decoupled_config(args, model_name)
        config = build_router_config(model_config.get("parameters", {}))
        self._metrics = ServingMetrics(pb_utils().MetricFamily, model=model_name, instance=instance)
        self._responses = new_dispatcher(instance)
        self._responses.start()
        self._router = Router(config, instance, model_name, RouterMetricsSink(self._metrics))
        self._router.start()
        self._orphan_watch = OrphanWatch(instance).start()
        self._server_watch = ServerShutdownWatch(instance, config.grpc_url, self._stop_for_shutdown).start()
        self._stub_guard = StubGuard(model_name, config.grpc_url).start()   # a dead stub gets replaced
        logger.info("%s ready: %s", instance, config)

    def _stop_for_shutdown(self) -> None:
        """The server is stopping: end every request now (tritonserver unloads a decoupled model only once each
        of its streams sent FINAL), and name any stream still open after that."""
        began = time.monotonic()
        self._router.stop(STOP_TIMEOUT_S)
        # a failed request's traceback keeps its frames (and their response senders) in reference cycles; a
        # python-backend response sender frees its request's response factory only when it is destroyed, and
        # tritonserver unloads the model only once every factory is gone (a stop after failures took the whole
        # 20 s exit timeout): collect them now
        gc.collect()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._responses.open_streams() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self._responses.open_streams()
        if left:
            logger.error("%d streams still without FINAL after the router stopped: %s", len(left), left[:20])
        logger.info("server shutting down: requests ended in %.2f s", time.monotonic() - began)

    def execute(self, requests: list[Any]) -> None:
        answer_each(requests, self._handle_one, self._responses, timing=self._metrics)

    def _handle_one(self, request: Any, sink: TritonResponseSink) -> None:
        parsed, raw = parse_client_request(request, sink)
        routed = RoutedRequest(parsed, raw)
        n = parsed.params.n
        if n == 1:
            self._submit(routed, sink)
            return
        # n samples: n routed requests (each its own pair and room), merged into the client's stream
        fan_in = SampleFanIn(sink, n, parsed.stream, parsed.params.logprobs is not None)
        for i in range(n):
            self._submit(routed.for_sample(i), fan_in.sample_sink(i))

    def _submit(self, routed: RoutedRequest, sink: ResponseSink) -> None:
        self._router.submit(routed, EnsembleResponder(routed.request, sink).emit, sink.is_cancelled)

    def finalize(self) -> None:
        began = time.monotonic()
        self._stub_guard.stop()   # first: this stub's end is no death to heal
        self._server_watch.stop()
        self._orphan_watch.stop()
        self._router.stop(STOP_TIMEOUT_S)
        self._responses.stop(STOP_TIMEOUT_S)
        self._metrics.close()   # a metric outliving finalize segfaults the stub's teardown (docs/architecture.md)
        logger.info("finalized in %.2f s", time.monotonic() - began)
        teardown_logging()
