"""Triton python-backend glue of the PD workers; ``model_repository/{prefill,decode}/1/model.py`` only pick
a class from here (the router's glue is ``serving.router.triton_model``).

``PDChildModel`` (prefill, decode), a ``serving.triton.host.ModelHost``: start → ``WorkerConfig`` →
``create_pd_worker`` → start, with the worker's own gRPC endpoint (``serving.workers.endpoint``, unless
``worker_port`` is -1) bound first and serving before the worker registers; handle → parse the child request →
``worker.handle``; stop → the worker (its requests end with an error and FINAL, on either path), then the
endpoint. Responses leave through the instance's ``ResponseDispatcher`` thread: the
engine loop never waits on Triton.

Identity: a PD model runs exactly one instance, known to the fleet as ``<model name>@<grpc_url>``
(fleet-unique: two servers may both serve a model named ``prefill``), with the Triton gRPC endpoint routers
reach it at (``grpc_url``, from ``PD_GRPC_URL`` or the model parameter). A request with
``pd_control = "describe"`` is answered at once with the instance's ``InstanceCard`` (its rendezvous URL): how
a router of the same tritonserver finds it with no registry.

Authentication: with a fleet secret every request here, ``describe`` included, must carry the router's
signature in its ``pd_fleet_auth`` parameter (``signing.AUTH_PARAMETER``, ``signing.sign_call``: bound
to this instance's id and to a digest of the request's model, id and inputs), checked by the worker's
``ChildAuth`` (``serving.workers.child_auth``, shared with its own endpoint: one replay guard for both paths)
before anything else; a request without a valid one gets one FINAL ``instance`` error, "unauthenticated child
request: ...".
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from serving.child.signing import AUTH_PARAMETER
from serving.config import ConfigError, apply_cpu_affinity, build_worker_config, instance_device
from serving.delta import ResponseChunk
from serving.parsing.pd_request import CONTROL_INPUT, DESCRIBE, PD_INPUT_NAMES, InstanceCard, parse_pd_request
from serving.parsing.request import INPUT_NAMES, RequestError
from serving.triton.host import ModelHost, wait_idle
from serving.triton.io import TritonResponseSink, read_parameters, scalars_from_arrays
from serving.workers.child_auth import NO_AUTH, ChildAuth
from serving.workers.endpoint import WorkerEndpoint
from serving.workers.fatal import exit_process_soon

logger = logging.getLogger(__name__)


def read_child_inputs(request: Any) -> dict[str, np.ndarray]:
    """Every input of one child request (a ``pb_utils.InferenceRequest``), as numpy arrays by name (``BYTES``:
    object arrays of bytes), as ``signing.inputs_digest`` takes them."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def read_signature(request: Any) -> str | None:
    """The fleet signature in the request's ``pd_fleet_auth`` parameter (``signing.AUTH_PARAMETER``); None
    when absent or not a string. Raises ``RequestError`` when the parameters are not a JSON object."""
    value = read_parameters(request).get(AUTH_PARAMETER)
    return value if isinstance(value, str) else None


class PDChildModel(ModelHost):
    """The prefill or decode model: one PD worker per model instance. ``ROLE`` (``"prefill"``/``"decode"``) is
    set by model.py (``serving.triton.entry.deferred_model``)."""

    ROLE = ""
    ANSWER_CHILD = True
    _endpoint: WorkerEndpoint | None = None
    _auth: ChildAuth = NO_AUTH

    def start(self, args: dict[str, Any], model_config: dict[str, Any]) -> str:
        _check_one_instance(model_config, self.ROLE)
        device = instance_device(args["model_instance_kind"], int(args["model_instance_device_id"]))
        config = build_worker_config(model_config.get("parameters", {}), device=device)
        self.drain_timeout_s = config.drain_timeout_s
        instance_id = f"{self.model_name}@{config.grpc_url}"
        self._auth = ChildAuth(config.fleet_secret, instance_id)   # both paths: one replay guard
        apply_cpu_affinity(config)
        # heavy imports (torch, nixl) after config checks
        from serving.workers.pd_factory import create_pd_worker

        self._endpoint = None if config.worker_port < 0 else WorkerEndpoint(
            config.grpc_url.rsplit(":", 1)[0], config.worker_port, self.model_name, self._auth,
            fleet_tls=config.fleet_tls).bind()
        try:
            # a dead rank: end as a dead stub (on_fatal)
            self._handle = create_pd_worker(self.ROLE, config, instance_id, self.metrics,
                                            model_name=self.model_name,
                                            worker_endpoint=self._endpoint.address if self._endpoint else "",
                                            on_fatal=exit_process_soon)
            # serving before the registration: routers may use it from then on
            if self._endpoint is not None:
                self._endpoint.start(self._handle.worker)
            self._handle.start()
        except BaseException:
            if self._endpoint is not None:
                self._endpoint.stop(0)
            raise
        self._card = InstanceCard(instance_id, self.ROLE, self.model_name, config.grpc_url,
                                  self._handle.kv_manager.rendezvous_url, self._handle.kv_manager_epoch)
        logger.info("%s ready as %s instance %s: %s", self.instance_name, self.ROLE, instance_id, config)
        return config.grpc_url

    def drain(self, timeout_s: float) -> int:
        """A server stop or an unload: out of the fleet first (its registry entry withdrawn, its rendezvous
        listing it ``draining``: routers stop pairing it within a refresh, and move a decode's open streams to
        another decode when there is one), new streams on the worker endpoint refused with an ``instance``
        error (routers retry them elsewhere; tritonserver refuses its own), then the requests in flight, on
        either path, run to their end up to ``timeout_s`` (a prefill's rooms finish their KV transfer).
        Returns how
        many are left (``stop`` ends them)."""
        began = time.monotonic()
        self._handle.withdraw(min(timeout_s, 2.0))
        if self._endpoint is not None:
            self._endpoint.refuse_new()
        endpoint = self._endpoint

        def in_flight() -> int:
            return max(self._handle.worker.num_active(), endpoint.num_active if endpoint else 0)

        logger.info("%s draining: %d requests in flight", self.instance_name, in_flight())
        left = wait_idle(in_flight, max(0.0, timeout_s - (time.monotonic() - began)))
        logger.info("%s drained in %.1f s (%d requests left to end with an error)", self.instance_name,
                    time.monotonic() - began, left)
        return left

    def stop(self, timeout_s: float) -> None:
        logger.info("stopping (%d requests in flight)", self._handle.worker.num_active())
        self._handle.stop(timeout_s)   # requests in flight end with an error and FINAL, on either path
        if self._endpoint is not None:   # then the endpoint, once those last responses are out
            self._endpoint.stop(grace_s=2.0)

    def handle(self, request: Any, sink: TritonResponseSink) -> None:
        arrays = read_child_inputs(request)
        # before any work: a request without the fleet's signature for this instance and these inputs ends
        self._auth.check(read_signature(request), self.model_name, request.request_id(), arrays)
        pd_inputs = {name: arrays[name] for name in (*PD_INPUT_NAMES, CONTROL_INPUT) if name in arrays}
        if CONTROL_INPUT in pd_inputs:
            command = np.asarray(pd_inputs[CONTROL_INPUT]).reshape(-1)[0]
            command = command.decode() if isinstance(command, bytes) else str(command)
            if command != DESCRIBE:
                raise RequestError(CONTROL_INPUT, f"unknown command {command!r} (known: {DESCRIBE!r})")
            sink.send(ResponseChunk.single(text=self._card.to_json()), final=True)
            return
        llm_inputs = scalars_from_arrays({name: arrays[name] for name in INPUT_NAMES if name in arrays})
        pd = parse_pd_request(llm_inputs, pd_inputs)
        self._handle.worker.handle(pd, sink)


def _check_one_instance(model_config: dict[str, Any], role: str) -> None:
    """A PD model runs one instance: the router addresses instances by (server, model name), and Triton would
    spread a model's requests over its instances. Raises ConfigError otherwise."""
    count = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
    if count != 1:
        raise ConfigError("instance_group", f"a {role} model runs exactly one instance (got {count}); for "
                          f"more {role} instances add models ({role}_1, ...): the router finds them at the "
                          "bootstrap")
