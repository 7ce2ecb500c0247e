"""Triton python-backend glue of the PD models; ``model_repository/{prefill,decode,pd_ensemble}/1/model.py``
only pick a class from here.

``PDChildModel`` (prefill, decode): initialize → ``WorkerConfig`` → ``create_pd_worker`` → start; execute →
parse each request (a bad input gets one error response with FINAL) → ``worker.handle``; finalize → stop the
worker, then destroy the custom metrics (``ServingMetrics.close``: a metric outliving ``finalize`` segfaults the
stub when it tears down).

``PDEnsembleModel`` (pd_ensemble, BLS): execute → parse → one orchestration per request on a worker thread;
each child request is a decoupled BLS call (``InferenceRequest.exec(decoupled=True)``) read on its own thread.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from serving.config import (ConfigError, apply_cpu_affinity, build_worker_config, instance_device,
                            read_bootstrap_url)
from serving.metrics import ServingMetrics
from serving.orchestrator import (
    ChildCall,
    ChildResponse,
    EnsembleResponder,
    PDOrchestrator,
    RoomAllocator,
    RoundRobinPairing,
)
from serving.orphan_watch import OrphanWatch
from serving.pd_request import PD_INPUT_NAMES, parse_pd_request
from serving.request import parse_request
from serving.triton_io import RawValue, TritonResponseSink, answer_each, pb_utils, read_inputs

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
CHILD_OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "error")
#: Inputs of the client's request that are forwarded as they are to both children.
FORWARDED_INPUTS = ("text_input", "sampling_parameters", "apply_chat_template")


def _setup_logging() -> None:
    """INFO logs to the server log; ``kill -USR1 <stub pid>`` dumps every Python thread's stack there too."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _teardown_logging() -> None:
    """``finalize``: the SIGUSR1 dump handler goes with the model (a stub must not dump a finalizing heap)."""
    faulthandler.unregister(signal.SIGUSR1)


def _decoupled_config(args: dict[str, Any], model: str) -> dict[str, Any]:
    model_config = json.loads(args["model_config"])
    if not pb_utils().using_decoupled_model_transaction_policy(model_config):
        raise pb_utils().TritonModelException(f"{model} must use the decoupled transaction policy")
    return model_config


def read_pd_inputs(request: Any) -> dict[str, np.ndarray]:
    """``bootstrap_room`` / ``prefill_instance`` of one child request, as numpy arrays (absent ones left out)."""
    arrays = {}
    for name in PD_INPUT_NAMES:
        tensor = pb_utils().get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


class PDChildModel:
    """The prefill or decode model: one PD worker per model instance. Subclasses set ``ROLE``."""

    ROLE = ""

    def initialize(self, args: dict[str, Any]) -> None:
        _setup_logging()
        model_config = _decoupled_config(args, args["model_name"])
        instance_id = self._instance_id(args, model_config)
        device = instance_device(args["model_instance_kind"], int(args["model_instance_device_id"]))
        config = build_worker_config(model_config.get("parameters", {}), device=device)
        apply_cpu_affinity(config)
        self._metrics = ServingMetrics(pb_utils().MetricFamily, model=args["model_name"],
                                       instance=args["model_instance_name"])
        from serving.pd_factory import create_pd_worker  # heavy imports (torch, nixl) after config checks

        self._handle = create_pd_worker(self.ROLE, config, instance_id, self._metrics)
        self._handle.start()
        self._orphan_watch = OrphanWatch(args["model_instance_name"]).start()
        logger.info("%s ready as %s instance %s: %s", args["model_instance_name"], self.ROLE, instance_id, config)

    def _instance_id(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        """Prefill: the model name (pd_ensemble pairs by model name, so one instance per prefill model);
        decode: the Triton instance name."""
        if self.ROLE != "prefill":
            return str(args["model_instance_name"])
        count = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
        if count != 1:
            raise ConfigError("instance_group", f"a prefill model runs exactly one instance (got {count}); for "
                              "more prefill instances add models (prefill_1, ...) to pd_ensemble's prefill_models")
        return str(args["model_name"])

    def execute(self, requests: list[Any]) -> None:
        answer_each(requests, self._handle_one, child=True)

    def _handle_one(self, request: Any, sink: TritonResponseSink) -> None:
        pd = parse_pd_request(read_inputs(request), read_pd_inputs(request), self.ROLE == "decode")
        self._handle.worker.handle(pd, sink)

    def finalize(self) -> None:
        logger.info("stopping (%d requests in flight)", self._handle.worker.num_active())
        self._orphan_watch.stop()
        self._handle.stop(STOP_TIMEOUT_S)
        self._metrics.close()   # after every thread that updates them stopped; before the stub tears down
        _teardown_logging()


def _child_response(response: Any) -> ChildResponse:
    """One BLS response of a child → ``ChildResponse`` (an empty response is the FINAL flag alone). Text
    outputs arrive as UTF-8 ``uint8`` arrays (``triton_io.child_response_arrays``)."""
    if response.has_error():
        return ChildResponse(error=response.error().message(), final=True)
    values = {}
    for name in CHILD_OUTPUTS:
        tensor = pb_utils().get_output_tensor_by_name(response, name)
        if tensor is not None:
            values[name] = tensor.as_numpy()
    if not values:
        return ChildResponse()

    def text(name: str) -> str:
        array = values.get(name)
        return "" if array is None else array.astype(np.uint8).tobytes().decode("utf-8")

    if text("error"):
        return ChildResponse(error=text("error"), final=True)

    def count(name: str) -> int:
        array = values.get(name)
        return 0 if array is None or array.size == 0 else int(array.reshape(-1)[0])

    return ChildResponse(text=text("text_output"), num_input_tokens=count("num_input_tokens"),
                         num_output_tokens=count("num_output_tokens"), finish_reason=text("finish_reason") or None)


class PDEnsembleModel:
    """The public entry point: rooms, pairing, and the merge of the two child streams."""

    def initialize(self, args: dict[str, Any]) -> None:
        _setup_logging()
        model_config = _decoupled_config(args, args["model_name"])
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        prefill_models = _model_list(params, "prefill_models", "prefill")
        decode_models = _model_list(params, "decode_models", "decode")
        max_inflight = int(params.get("max_inflight_requests", "256"))
        idle_timeout_s = float(params.get("request_idle_timeout_s", "300"))
        self._bootstrap_url = read_bootstrap_url(params.get("bootstrap_url", "http://127.0.0.1:8998"))
        self._orchestrations = ThreadPoolExecutor(max_inflight, thread_name_prefix="pd-request")
        self._readers = ThreadPoolExecutor(2 * max_inflight, thread_name_prefix="pd-child")
        self._client_lock = threading.Lock()
        from bootstrap.client import BootstrapClient

        self._client = BootstrapClient(self._bootstrap_url)
        self._orchestrator = PDOrchestrator(RoundRobinPairing(prefill_models, decode_models), RoomAllocator(),
                                            self._abort_room, self._readers, idle_timeout_s=idle_timeout_s)
        self._orphan_watch = OrphanWatch(args["model_instance_name"]).start()
        logger.info("pd_ensemble ready: prefill=%s decode=%s bootstrap=%s", prefill_models, decode_models,
                    self._bootstrap_url)

    def execute(self, requests: list[Any]) -> None:
        answer_each(requests, self._handle_one)

    def _handle_one(self, request: Any, sink: TritonResponseSink) -> None:
        raw = read_inputs(request)
        responder = EnsembleResponder(parse_request(raw), sink)
        self._orchestrations.submit(self._orchestrator.generate, lambda call: self._launch(call, raw),
                                    responder.emit, sink.is_cancelled)

    def _launch(self, call: ChildCall, raw: dict[str, RawValue]) -> Iterator[ChildResponse]:
        pb = pb_utils()
        tensors = [pb.Tensor(name, _input_array(raw[name])) for name in FORWARDED_INPUTS if name in raw]
        tensors.append(pb.Tensor("bootstrap_room", np.array([call.room], dtype=np.int64)))
        if call.role == "decode":
            tensors.append(pb.Tensor("prefill_instance", np.array([call.prefill_model.encode()], dtype=np.object_)))
        request = pb.InferenceRequest(model_name=call.model, inputs=tensors,
                                      requested_output_names=list(CHILD_OUTPUTS))
        logger.debug("room=%d: %s request to %s", call.room, call.role, call.model)
        # exec() returns only once the child has sent its first response (tritonserver 2.51), and prefill's
        # first response needs decode's destination: never hold a lock across it (the pair would deadlock)
        responses = request.exec(decoupled=True)
        for response in responses:
            yield _child_response(response)
        logger.debug("room=%d: %s stream from %s ended", call.room, call.role, call.model)

    def _abort_room(self, room: int, reason: str) -> None:
        from bootstrap.errors import BootstrapError

        try:
            with self._client_lock:
                self._client.abort_room(room, reason)
        except BootstrapError as e:
            logger.warning("room=%d: abort not delivered to the bootstrap service: %s", room, e)

    def finalize(self) -> None:
        self._orchestrations.shutdown(wait=False)  # queued requests still end: their children fail
        self._readers.shutdown(wait=False)
        self._client.close()
        self._orphan_watch.stop()
        _teardown_logging()


def _model_list(params: dict[str, str], key: str, default: str) -> list[str]:
    models = [m.strip() for m in params.get(key, default).split(",") if m.strip()]
    if not models:
        raise ConfigError(key, "must name at least one model")
    return models


def _input_array(value: RawValue) -> np.ndarray:
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    return np.array([value if isinstance(value, bytes) else str(value).encode()], dtype=np.object_)
