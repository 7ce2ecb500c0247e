"""``ColocatedModel``: the Triton python-backend model of the colocated worker (decoupled), behind
``model_repository/colocated/1/model.py`` (``serving.triton_entry.deferred_model``).

initialize: model config ``parameters`` → ``WorkerConfig`` → ``ColocatedWorker`` (loads the model) → start.
execute: for each request, inputs → ``GenerateRequest`` (a bad input gets one error response with FINAL),
then ``ColocatedWorker.handle``, which answers through the instance's response thread (``ResponseDispatcher``).
finalize: stop the worker (requests still in flight end with an error response and FINAL), then the response
thread once it has sent them, then destroy the custom metrics while the stub can still tell tritonserver
(``ServingMetrics.close``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import triton_python_backend_utils as pb_utils

from serving.colocated import ColocatedWorker
from serving.config import apply_cpu_affinity, build_worker_config, instance_device
from serving.metrics import ServingMetrics
from serving.orphan_watch import OrphanWatch
from serving.server_watch import ServerShutdownWatch
from serving.stub_guard import StubGuard
from serving.triton_io import answer_each, new_dispatcher, parse_client_request

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


class ColocatedModel:
    """One colocated engine per model instance."""

    def initialize(self, args: dict[str, Any]) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("colocated must use the decoupled transaction policy")
        device = instance_device(args["model_instance_kind"], int(args["model_instance_device_id"]))
        config = build_worker_config(model_config.get("parameters", {}), device=device)
        apply_cpu_affinity(config)
        instance = args["model_instance_name"]
        self._metrics = ServingMetrics(pb_utils.MetricFamily, model=args["model_name"], instance=instance)
        self._worker = ColocatedWorker.create(config, name=instance, metrics=self._metrics)
        self._responses = new_dispatcher(instance)   # the engine loop only queues responses
        self._responses.start()
        self._worker.start()
        self._orphan_watch = OrphanWatch(instance).start()
        # a server stop ends the requests in flight at once (tritonserver waits for them before finalize)
        self._server_watch = ServerShutdownWatch(instance, config.grpc_url,
                                                 self._stop_worker).start()
        self._stub_guard = StubGuard(args["model_name"], config.grpc_url).start()   # a dead stub gets replaced
        logger.info("%s ready: %s", instance, config)

    def _stop_worker(self) -> None:
        self._worker.stop(STOP_TIMEOUT_S)

    def execute(self, requests: list[Any]) -> None:
        answer_each(requests, lambda request, sink: self._worker.handle(parse_client_request(request, sink)[0], sink),
                    self._responses, timing=self._metrics)

    def finalize(self) -> None:
        logger.info("stopping (%d requests in flight)", self._worker.num_active())
        self._stub_guard.stop()   # first: this stub's end is no death to heal
        self._server_watch.stop()
        self._orphan_watch.stop()
        self._worker.stop(STOP_TIMEOUT_S)
        self._responses.stop(STOP_TIMEOUT_S)   # after the worker: its requests' FINALs go out first
        self._metrics.close()
