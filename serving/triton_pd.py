"""Triton python-backend glue of the PD workers; ``model_repository/{prefill,decode}/1/model.py`` only pick
a class from here (the router's glue is ``serving.router.triton_model``).

``PDChildModel`` (prefill, decode): initialize → ``WorkerConfig`` → ``create_pd_worker`` → start; execute →
parse each request (a bad input gets one error response with FINAL) → ``worker.handle``; finalize → stop the
worker, then the response thread once it sent their FINALs, then destroy the custom metrics
(``ServingMetrics.close``: a metric outliving ``finalize`` segfaults the stub when it tears down).
Responses leave through the instance's ``ResponseDispatcher`` thread: the engine loop never waits on Triton.

Identity: a PD model runs exactly one instance, known to the fleet as ``<model name>@<grpc_url>``
(fleet-unique: two servers may both serve a model named ``prefill``), with the Triton gRPC endpoint routers
reach it at (``grpc_url``, from ``PD_GRPC_URL`` or the model parameter). A request with ``pd_control =
"describe"`` is answered at once with the instance's ``InstanceCard`` (its rendezvous URL): how a router of the
same tritonserver finds it with no registry.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
from typing import Any

import numpy as np

from serving.config import ConfigError, apply_cpu_affinity, build_worker_config, instance_device
from serving.metrics import ServingMetrics
from serving.orphan_watch import OrphanWatch
from serving.pd_request import CONTROL_INPUT, DESCRIBE, PD_INPUT_NAMES, InstanceCard, parse_pd_request
from serving.request import RequestError
from serving.stream import ResponseChunk
from serving.server_watch import ServerShutdownWatch
from serving.stub_guard import StubGuard
from serving.triton_io import TritonResponseSink, answer_each, new_dispatcher, pb_utils, read_inputs

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


def setup_logging() -> None:
    """INFO logs to the server log; ``kill -USR1 <stub pid>`` dumps every Python thread's stack there too."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def teardown_logging() -> None:
    """``finalize``: the SIGUSR1 dump handler goes with the model (a stub must not dump a finalizing heap)."""
    faulthandler.unregister(signal.SIGUSR1)


def decoupled_config(args: dict[str, Any], model: str) -> dict[str, Any]:
    model_config = json.loads(args["model_config"])
    if not pb_utils().using_decoupled_model_transaction_policy(model_config):
        raise pb_utils().TritonModelException(f"{model} must use the decoupled transaction policy")
    return model_config


def read_pd_inputs(request: Any) -> dict[str, np.ndarray]:
    """``bootstrap_room`` / ``prefill_instance`` of one child request, as numpy arrays (absent ones left out)."""
    arrays = {}
    for name in (*PD_INPUT_NAMES, CONTROL_INPUT):
        tensor = pb_utils().get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


class PDChildModel:
    """The prefill or decode model: one PD worker per model instance. ``ROLE`` (``"prefill"``/``"decode"``) is
    set by model.py (``serving.triton_entry.deferred_model``)."""

    ROLE = ""

    def initialize(self, args: dict[str, Any]) -> None:
        setup_logging()
        model_name = str(args["model_name"])
        model_config = decoupled_config(args, model_name)
        _check_one_instance(model_config, self.ROLE)
        device = instance_device(args["model_instance_kind"], int(args["model_instance_device_id"]))
        config = build_worker_config(model_config.get("parameters", {}), device=device)
        instance_id = f"{model_name}@{config.grpc_url}"
        apply_cpu_affinity(config)
        self._metrics = ServingMetrics(pb_utils().MetricFamily, model=model_name,
                                       instance=args["model_instance_name"])
        from serving.pd_factory import create_pd_worker  # heavy imports (torch, nixl) after config checks

        self._responses = new_dispatcher(args["model_instance_name"])
        self._responses.start()
        self._handle = create_pd_worker(self.ROLE, config, instance_id, self._metrics, model_name=model_name)
        self._handle.start()
        self._card = InstanceCard(instance_id, self.ROLE, model_name, config.grpc_url,
                                  self._handle.kv_manager.rendezvous_url, self._handle.kv_manager_epoch)
        self._orphan_watch = OrphanWatch(args["model_instance_name"]).start()
        self._server_watch = ServerShutdownWatch(args["model_instance_name"], config.grpc_url,
                                                 self._stop_worker).start()
        self._stub_guard = StubGuard(model_name, config.grpc_url).start()   # a dead stub gets replaced
        logger.info("%s ready as %s instance %s: %s", args["model_instance_name"], self.ROLE, instance_id, config)

    def _stop_worker(self) -> None:
        self._handle.stop(STOP_TIMEOUT_S)

    def execute(self, requests: list[Any]) -> None:
        answer_each(requests, self._handle_one, self._responses, child=True)

    def _handle_one(self, request: Any, sink: TritonResponseSink) -> None:
        pd_inputs = read_pd_inputs(request)
        if CONTROL_INPUT in pd_inputs:
            command = np.asarray(pd_inputs[CONTROL_INPUT]).reshape(-1)[0]
            command = command.decode() if isinstance(command, bytes) else str(command)
            if command != DESCRIBE:
                raise RequestError(CONTROL_INPUT, f"unknown command {command!r} (known: {DESCRIBE!r})")
            sink.send(ResponseChunk.single(text=self._card.to_json()), final=True)
            return
        pd = parse_pd_request(read_inputs(request), pd_inputs)
        self._handle.worker.handle(pd, sink)

    def finalize(self) -> None:
        logger.info("stopping (%d requests in flight)", self._handle.worker.num_active())
        self._stub_guard.stop()   # first: this stub's end is no death to heal
        self._server_watch.stop()
        self._orphan_watch.stop()
        self._handle.stop(STOP_TIMEOUT_S)
        self._responses.stop(STOP_TIMEOUT_S)   # after the worker: the FINALs of its failed requests go out
        self._metrics.close()   # after every thread that updates them stopped; before the stub tears down
        teardown_logging()


def _check_one_instance(model_config: dict[str, Any], role: str) -> None:
    """A PD model runs one instance: the router addresses instances by (server, model name), and Triton would
    spread a model's requests over its instances. Raises ConfigError otherwise."""
    count = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
    if count != 1:
        raise ConfigError("instance_group", f"a {role} model runs exactly one instance (got {count}); for more "
                          f"{role} instances add models ({role}_1, ...): the router finds them at the bootstrap")
