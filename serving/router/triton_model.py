"""Triton python-backend adapter of the router (``model_repository/pd_ensemble``, decoupled), a
``serving.triton.host.ModelHost``.

start: parameters → ``RouterConfig`` (an unknown key or a bad value fails the load, naming it) → a started
``Router`` (its own event loop thread). handle: parse each request and hand it to the router; nothing blocks
Triton's thread. drain (a server stop): the router admits nothing more and its open streams run to their end,
up to ``drain_timeout_s``. stop: the router (requests in flight end with an error and FINAL; their child
streams are cancelled, so the workers drop their rooms).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from serving.router.config import build_router_config
from serving.router.metrics import RouterMetricsSink
from serving.router.orchestrator import RoutedRequest
from serving.router.responder import EnsembleResponder
from serving.router.service import Router
from serving.stream import ResponseSink
from serving.triton.host import ModelHost
from serving.triton.io import TritonResponseSink, parse_client_request
from serving.workers.parallel_sampling import SampleFanIn

logger = logging.getLogger(__name__)


class RouterModel(ModelHost):
    """``pd_ensemble``: the PD router."""

    STOP_TIMEOUT_S = 15.0

    def start(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        config = build_router_config(model_config.get("parameters", {}))
        self.drain_timeout_s = config.drain_timeout_s
        self._router = Router(config, self.instance_name, self.model_name, RouterMetricsSink(self.metrics))
        self._router.start()
        logger.info("%s ready: %s", self.instance_name, config)
        return config.grpc_url

    def stop(self, timeout_s: float) -> None:
        began = time.monotonic()
        self._router.stop(timeout_s)
        logger.info("router stopped in %.2f s", time.monotonic() - began)

    def drain(self, timeout_s: float) -> int:
        """New requests refused ("the router is draining"), open streams run to their end (their children keep
        going; a decode that drains too has them moved to another decode by the router), up to ``timeout_s``;
        returns how many are left."""
        return self._router.drain(timeout_s)

    def on_server_stop(self) -> None:
        """The server is stopping: drain (open streams run to their end, up to ``drain_timeout_s``), then end
        what is left (tritonserver unloads a decoupled model only once each of its streams sent FINAL), and
        name any stream still open after that."""
        began = time.monotonic()
        left = self.drain(self.drain_left_s())
        logger.info("server stopping: router drained in %.2f s (%d requests left to end with an error)",
                    time.monotonic() - began, left)
        self.stop(self.STOP_TIMEOUT_S)
        # a failed request's traceback keeps its frames (and their response senders) in reference cycles; a
        # python-backend response sender frees its request's response factory only when it is destroyed, and
        # tritonserver unloads the model only once every factory is gone (a stop after failures took the whole
        # 20 s exit timeout): collect them now
        gc.collect()
        deadline = time.monotonic() + self.STOP_TIMEOUT_S
        while self.responses.open_streams() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.responses.open_streams()
        if left:
            logger.error("%d streams still without FINAL after the router stopped: %s", len(left), left[:20])
        logger.info("server shutting down: requests ended in %.2f s", time.monotonic() - began)

    def handle(self, request: Any, sink: TritonResponseSink) -> None:
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
