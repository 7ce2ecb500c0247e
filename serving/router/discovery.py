"""Where a router's fleet comes from: the members of the fleet (who), before their load and health (how).

Two sources, one ``MemberSource`` seam:

- ``LocalServerMembers`` (no registry, the default): the PD workers of the router's own tritonserver. Triton's
  repository index lists the READY models; a model whose inputs include ``pd_control`` is a PD worker, and a
  ``describe`` request (``serving.parsing.pd_request.InstanceCard``) tells its instance id, role and
  rendezvous URL. This is what makes plain ``tritonserver --model-repository`` work with nothing beside it.
- ``RegistryMembers``: the fleet's membership registry (``bootstrap.membership``: the embedded registry
  service or etcd), for fleets across servers. Losing the registry freezes the member list; it does not empty
  it.

Either way the router then asks each member's own rendezvous for its load and health (``FleetWatcher``), so no
central process sits between a router and the instances it pairs.

Threads: a source is called from the fleet watcher's thread only (``members``, ``forget``, ``close``).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from serving.child.signing import AUTH_PARAMETER, sign_call
from serving.parsing.pd_request import CONTROL_INPUT, DESCRIBE, InstanceCard
from serving.triton.admin_access import admin_headers
from serving.triton.control_client import control_client
from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger(__name__)
#: How long the router's own server may refuse its repository index at start-up before that is worth a warning
#: (tritonserver opens its gRPC port once every model loaded; a real model's load takes tens of seconds).
STARTUP_GRACE_S = 120.0

DESCRIBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FleetMember:
    """One member of the fleet as a router needs it before asking for its load.

    Attributes:
        instance_id: ``<model>@<grpc host:port>``, fleet-unique.
        role: ``"prefill"`` or ``"decode"``.
        address: Triton gRPC endpoint (``host:port``) that serves ``model_name``.
        model_name: the Triton model.
        rendezvous_url: the instance's own rendezvous (``http://host:port``): load, health, registration.
        epoch: changes on every start of the instance.
    """

    instance_id: str
    role: str
    address: str
    model_name: str
    rendezvous_url: str
    epoch: int = 0


class MemberSource(Protocol):
    """The members of the fleet; called on the fleet watcher's thread only."""

    def members(self) -> tuple[list[FleetMember], bool]:
        """The members known now and whether the source answered (False: the last known members, frozen).
        Blocks at most a few seconds; never raises."""
        ...

    def forget(self, instance_id: str) -> None:
        """The member's rendezvous refused a connection (its process is gone), or lists it draining (its model
        is being unloaded; a reload's successor serves that model now): learn it anew next time."""
        ...

    def close(self) -> None: ...


class LocalServerMembers:
    """The PD workers of one tritonserver (the router's own), found through its repository index (an admin
    API: with a fleet secret, read with the admin key, ``serving.triton.admin_access``)."""

    def __init__(self, grpc_url: str, timeout_s: float = DESCRIBE_TIMEOUT_S,
                 fleet_secret: bytes | None = None, tls: GrpcTls | None = None) -> None:
        self._grpc_url = grpc_url
        self._timeout_s = timeout_s
        self._admin_headers = admin_headers(fleet_secret, grpc=True)
        self._secret = fleet_secret   # signs each describe request (checked as any child request)
        self._tls = tls
        self._client: Any = None
        self._cards: dict[str, InstanceCard] = {}   # model name → its card
        self._not_pd: set[str] = set()              # READY models without a pd_control input
        self._last: list[FleetMember] = []
        self._failing_since_s: float | None = None   # monotonic: the index unread since then
        self._warned = False      # this failure was logged at WARNING
        self._ever_read = False   # read once: failures after it are not the server's start

    def members(self) -> tuple[list[FleetMember], bool]:
        try:
            ready = self._ready_models()
        except Exception as e:   # the server is loading, stopping or unreachable: keep the last view
            # once when it starts failing (a server still starting or stopping answers UNAVAILABLE every
            # round, 4 a second), then at debug level until it reads again; while the server starts (the
            # router's model loads before tritonserver opens its gRPC port: refused at first, every start)
            # only once that took longer than STARTUP_GRACE_S
            now = time.monotonic()
            if self._failing_since_s is None:
                self._failing_since_s = now
            starting = not self._ever_read
            first = not self._warned and (not starting or now - self._failing_since_s > STARTUP_GRACE_S)
            (logger.warning if first else logger.debug)(
                "repository index of %s not read%s (retrying every round): %s", self._grpc_url,
                f" {now - self._failing_since_s:.0f} s after the router started" if starting else "", e)
            self._warned = self._warned or first
            self.close()   # the next round connects afresh instead of waiting out this channel's backoff
            return list(self._last), False
        if self._failing_since_s is not None and self._warned:
            logger.info("repository index of %s read again after %.1f s", self._grpc_url,
                        time.monotonic() - self._failing_since_s)
        self._failing_since_s, self._warned, self._ever_read = None, False, True
        for gone in set(self._cards) - ready:
            del self._cards[gone]
        self._not_pd &= ready
        for model in sorted(ready - set(self._cards) - self._not_pd):
            self._learn(model)
        self._last = [FleetMember(c.instance_id, c.role, c.address, c.model_name, c.rendezvous_url, c.epoch)
                      for c in self._cards.values()]
        return list(self._last), True

    def forget(self, instance_id: str) -> None:
        for model, card in list(self._cards.items()):
            if card.instance_id == instance_id:
                del self._cards[model]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _grpc(self) -> Any:
        if self._client is None:
            self._client = control_client(self._grpc_url, self._tls)
        return self._client

    def _ready_models(self) -> set[str]:
        index = self._grpc().get_model_repository_index(headers=self._admin_headers or None, as_json=True,
                                                         client_timeout=self._timeout_s)
        return {m["name"] for m in index.get("models", []) if m.get("state") == "READY"}

    def _learn(self, model: str) -> None:
        try:
            metadata = self._grpc().get_model_metadata(model, as_json=True, client_timeout=self._timeout_s)
            if CONTROL_INPUT not in {i["name"] for i in metadata.get("inputs", [])}:
                self._not_pd.add(model)
                return
            # the worker's instance id is <model>@<its grpc_url>, which is this server's: the signed authority
            card = describe(self._grpc(), model, self._timeout_s, self._secret, f"{model}@{self._grpc_url}")
        except Exception as e:   # loading, unloading or a dead stub: asked again next round
            logger.info("PD model %s not described yet: %s", model, e)
            return
        if card.address != self._grpc_url:
            logger.info("%s says it is served at %s; this router reaches it at %s", model, card.address,
                        self._grpc_url)
        self._cards[model] = card
        logger.info("fleet member %s (%s) at rendezvous %s", card.instance_id, card.role, card.rendezvous_url)


def describe(client: Any, model: str, timeout_s: float, fleet_secret: bytes | None = None,
             instance_id: str = "") -> InstanceCard:
    """Ask PD worker ``model`` for its card over one gRPC stream (the model is decoupled). The stream is
    half-closed only after the FINAL flag (cancelling right after FINAL keeps tritonserver 2.51 from unloading
    the model later). With ``fleet_secret`` the request is signed for ``instance_id``
    (``signing.sign_call``, in its ``pd_fleet_auth`` parameter), as every child request is. Raises
    ``TimeoutError``, ``ValueError`` (a bad card), ``RuntimeError`` (the worker's error, e.g. a refused
    signature) or the client's errors."""
    from tritonclient.grpc import InferInput

    arrays = {"text_input": np.array([b""], dtype=np.object_),
              CONTROL_INPUT: np.array([DESCRIBE.encode()], dtype=np.object_)}
    parameters = None if fleet_secret is None else {
        AUTH_PARAMETER: sign_call(fleet_secret, instance_id, model, "", arrays, time.time())}
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs = [InferInput(name, list(array.shape), "BYTES") for name, array in arrays.items()]
        for tensor, array in zip(inputs, arrays.values()):
            tensor.set_data_from_numpy(array)
        client.async_stream_infer(model, inputs, enable_empty_final_response=True, parameters=parameters)
        deadline = time.monotonic() + timeout_s
        card: InstanceCard | None = None
        while True:
            result, error = answers.get(timeout=max(0.01, deadline - time.monotonic()))
            if error is not None:
                raise RuntimeError(f"describe {model}: {error}")
            failure = result.as_numpy("error")
            if failure is not None and np.size(failure):
                raise RuntimeError(f"describe {model}: {np.asarray(failure, np.uint8).tobytes().decode()}")
            text = result.as_numpy("text_output")
            if text is not None and np.size(text):
                card = InstanceCard.from_json(np.asarray(text).astype(np.uint8).tobytes().decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except queue.Empty:
        raise TimeoutError(f"describe {model}: no answer within {timeout_s:g} s") from None
    finally:
        client.stop_stream(cancel_requests=False)
    if card is None:
        raise ValueError(f"describe {model}: the answer held no card")
    return card
