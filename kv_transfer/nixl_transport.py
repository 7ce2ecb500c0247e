"""NIXL transport (UCX backend): the only module that imports nixl.

Facts it relies on (docs/protocol.md has the measurements): memory is registered once; the descriptor list of
every KV block and aux slot is prepared once for ourselves and once per peer (``prep_xfer_dlist``), and each
chunk is one ``make_prepped_xfer`` with index lists — NIXL merges runs contiguous on both sides — which cost
~80 us per request against ~430 us for building descriptor lists per chunk; a peer's connection is warmed up at
handshake with a notification (the first transfer to a new peer otherwise pays ~10 ms of lazy set-up); the
progress thread is off because the manager thread polls; failures raise (a dead peer gives
``nixlRemoteDisconnectError`` from ``transfer``/``check_xfer_state``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np

from kv_transfer.aux import AUX_SLOT_BYTES
from kv_transfer.blocks import BlockTable
from kv_transfer.transport import Transport, TransportError, XferState

logger = logging.getLogger(__name__)
_agent_counter = itertools.count()
LOCAL = "NIXL_INIT_AGENT"   # nixl's name for "this agent" in prep_xfer_dlist

# UCX settings for loopback/host memory: notifications through shared memory, TCP pinned to lo.
# This is the one place the package touches the environment; values already set by the operator win.
UCX_DEFAULTS = {"UCX_MM_ERROR_HANDLING": "y", "UCX_NET_DEVICES": "lo"}


def _nixl_errors() -> tuple[type[BaseException], ...]:
    from nixl import _bindings  # type: ignore[import-not-found]
    found = tuple(getattr(_bindings, n) for n in dir(_bindings)
                  if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_bindings, n), type))
    return found + (RuntimeError,)


class NixlTransport(Transport):
    def __init__(self, instance_id: str, mem_type: str = "DRAM", device_id: int = 0) -> None:
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

        self._name = f"{instance_id}#{os.getpid()}-{time.time_ns()}-{next(_agent_counter)}"
        self._mem_type = mem_type
        self._device_id = device_id
        self._errors = _nixl_errors()
        self._agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._reg_descs: object | None = None
        self._local_dlist: object | None = None
        self._peer_dlists: dict[str, object] = {}

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, table: BlockTable) -> None:
        regions = [(table.kv_base_ptr, table.num_kv_blocks * table.layout.block_bytes, self._device_id, ""),
                   (table.aux_base_ptr, table.aux_slots * AUX_SLOT_BYTES, self._device_id, "")]
        self._reg_descs = self._agent.register_memory(regions, self._mem_type)
        self._local_dlist = self._agent.prep_xfer_dlist(LOCAL, table.descriptors(self._device_id), self._mem_type)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peer_dlists[name] = self._agent.prep_xfer_dlist(name, table.descriptors(self._device_id),
                                                                  self._mem_type)
            self._agent.send_notif(name, b"")  # warm-up: opens the connection now, not on the first chunk
        except self._errors as exc:
            raise TransportError(f"cannot add peer: {exc!r}") from exc
        return name

    def remove_peer(self, agent_name: str) -> None:
        dlist = self._peer_dlists.pop(agent_name, None)
        try:
            if dlist is not None:
                self._agent.release_dlist_handle(dlist)
            self._agent.remove_remote_agent(agent_name)
        except self._errors as exc:
            logger.warning("removing peer %s failed: %r", agent_name, exc)

    def post_write(self, peer: str, local_indices: np.ndarray, remote_indices: np.ndarray, notif: bytes) -> object:
        remote = self._peer_dlists.get(peer)
        if remote is None or self._local_dlist is None:
            raise TransportError(f"agent {peer} was not added")
        handle = None
        try:
            handle = self._agent.make_prepped_xfer("WRITE", self._local_dlist, local_indices, remote,
                                                   remote_indices, notif)
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
        for name in list(self._peer_dlists):
            self.remove_peer(name)
        try:
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
        except self._errors as exc:
            logger.warning("releasing registered memory failed: %r", exc)
        self._local_dlist = self._reg_descs = None

    def _safe_release(self, handle: object) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors as exc:
            logger.warning("release_xfer_handle failed: %r", exc)
