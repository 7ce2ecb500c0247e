"""NIXL transport (UCX backend): the only module that imports nixl.

Facts it relies on (docs/protocol.md has the measurements): regions are registered once; a peer's metadata is
loaded once and its connection warmed up with a notification (the first transfer to a new peer otherwise pays
~10 ms of lazy connection set-up); the progress thread is off because the manager thread polls; failures
raise (a dead peer gives ``nixlRemoteDisconnectError`` from ``transfer``/``check_xfer_state``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np

from kv_transfer.transport import Region, Transport, TransportError, XferState

logger = logging.getLogger(__name__)
_agent_counter = itertools.count()

# UCX settings for loopback/host memory: notifications through shared memory, TCP pinned to lo.
# This is the one place the package touches the environment; values already set by the operator win.
UCX_DEFAULTS = {"UCX_MM_ERROR_HANDLING": "y", "UCX_NET_DEVICES": "lo"}


def _nixl_errors() -> tuple[type[BaseException], ...]:
    from nixl import _bindings  # type: ignore[import-not-found]
    return tuple(getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")
                 and isinstance(getattr(_bindings, n), type)) or (RuntimeError,)


class NixlTransport(Transport):
    def __init__(self, instance_id: str, mem_type: str = "DRAM", device_id: int = 0) -> None:
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

        self._name = f"{instance_id}#{os.getpid()}-{time.time_ns()}-{next(_agent_counter)}"
        self._mem_type = mem_type
        self._device_id = device_id
        self._errors = _nixl_errors() + (RuntimeError,)
        self._agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._reg_descs: object | None = None

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, regions: list[Region]) -> None:
        descs = [(r.base_ptr, r.nbytes, self._device_id, "") for r in regions]
        self._reg_descs = self._agent.register_memory(descs, self._mem_type)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._agent.send_notif(name, b"")  # warm-up: opens the connection now, not on the first chunk
        except self._errors as exc:
            raise TransportError(f"cannot add peer: {exc!r}") from exc
        return name

    def remove_peer(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except self._errors as exc:
            logger.warning("remove_remote_agent(%s) failed: %r", agent_name, exc)

    def post_write(self, peer: str, spans: np.ndarray, notif: bytes) -> object:
        dev = np.full((len(spans), 1), self._device_id, dtype=np.int64)
        local = np.hstack([spans[:, 0:1], spans[:, 2:3], dev])   # [n, (addr, len, dev)]
        remote = np.hstack([spans[:, 1:2], spans[:, 2:3], dev])
        handle = None
        try:
            local_descs = self._agent.get_xfer_descs(local, self._mem_type)
            remote_descs = self._agent.get_xfer_descs(remote, self._mem_type)
            handle = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, notif)
            if self._agent.transfer(handle) == "ERR":
                raise TransportError(f"transfer to {peer} returned ERR")
        except self._errors as exc:
            if handle is not None:
                self._safe_release(handle)
            raise TransportError(f"write to {peer} failed: {exc!r}") from exc
        return handle

    def check(self, handle: object) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(handle))
        except self._errors as exc:
            logger.warning("check_xfer_state failed: %r", exc)
            return XferState.ERR

    def release(self, handle: object) -> None:
        self._safe_release(handle)

    def send_notif(self, peer: str, notif: bytes) -> None:
        try:
            self._agent.send_notif(peer, notif)
        except self._errors as exc:
            raise TransportError(f"notification to {peer} failed: {exc!r}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out = []
        for sender, messages in self._agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((name, bytes(m)) for m in messages if m)
        return out

    def close(self) -> None:
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except self._errors as exc:
                logger.warning("deregister_memory failed: %r", exc)
            self._reg_descs = None

    def _safe_release(self, handle: object) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors as exc:
            logger.warning("release_xfer_handle failed: %r", exc)
