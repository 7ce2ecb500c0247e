"""``ColocatedModel``: the Triton python-backend model of the colocated worker (decoupled), behind
``model_repository/colocated/1/model.py`` (``serving.triton.entry.deferred_model``); the lifecycle it shares
with the other models is ``serving.triton.host.ModelHost``.

start: model config ``parameters`` → ``WorkerConfig`` → ``ColocatedWorker`` (loads the model) → start.
handle: inputs → ``GenerateRequest`` → ``ColocatedWorker.handle``, which answers through the instance's
response thread. drain (a server stop): tritonserver refuses new requests; the ones in flight run to their end
up to ``drain_timeout_s``. stop: the worker (requests still in flight end with an error response and FINAL).
"""

from __future__ import annotations

import logging
from typing import Any

from serving.config import apply_cpu_affinity, build_worker_config, instance_device
from serving.triton.host import ModelHost, wait_idle
from serving.triton.io import TritonResponseSink, parse_client_request
from serving.workers.colocated import ColocatedWorker
from serving.workers.fatal import exit_process_soon

logger = logging.getLogger(__name__)


class ColocatedModel(ModelHost):
    """One colocated engine per model instance."""

    def start(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        device = instance_device(args["model_instance_kind"], int(args["model_instance_device_id"]))
        config = build_worker_config(model_config.get("parameters", {}), device=device)
        self.drain_timeout_s = config.drain_timeout_s
        apply_cpu_affinity(config)
        self._worker = ColocatedWorker.create(config, name=self.instance_name, metrics=self.metrics,
                                              on_fatal=exit_process_soon)   # a dead rank: end as a dead stub
        self._worker.start()
        logger.info("%s ready: %s", self.instance_name, config)
        return config.grpc_url

    def drain(self, timeout_s: float) -> int:
        """The requests in flight (all came through tritonserver, which refuses new ones once it stops) run to
        their end, up to ``timeout_s``; returns how many are left."""
        return wait_idle(self._worker.num_active, timeout_s)

    def stop(self, timeout_s: float) -> None:
        logger.info("stopping (%d requests in flight)", self._worker.num_active())
        self._worker.stop(timeout_s)

    def handle(self, request: Any, sink: TritonResponseSink) -> None:
        self._worker.handle(parse_client_request(request, sink)[0], sink)
