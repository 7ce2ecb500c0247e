"""In-process transport: managers that live in one process write into each other's memory with memmove.

A real second backend, used by the contract tests: a ``Fabric`` plays the network (agents find each other
in it by name); a write copies every span, then queues the notification at the peer.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
from collections import deque

import numpy as np

from kv_transfer.blocks import BlockTable, merge_runs
from kv_transfer.config import KVArgs
from kv_transfer.transport import BackendOptions, Transport, TransportError, XferState


class Fabric:
    """The "network" of one process: agent name → notification inbox. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, deque[tuple[str, bytes]]] = {}

    def attach(self, agent_name: str) -> deque[tuple[str, bytes]]:
        with self._lock:
            inbox: deque[tuple[str, bytes]] = deque()
            self._inboxes[agent_name] = inbox
            return inbox

    def detach(self, agent_name: str) -> None:
        with self._lock:
            self._inboxes.pop(agent_name, None)

    def is_attached(self, agent_name: str) -> bool:
        with self._lock:
            return agent_name in self._inboxes

    def deliver(self, sender: str, peer: str, notif: bytes) -> None:
        with self._lock:
            inbox = self._inboxes.get(peer)
        if inbox is None:
            raise TransportError(f"agent {peer} is not reachable")
        inbox.append((sender, notif))


DEFAULT_FABRIC = Fabric()
_agent_counter = itertools.count()


class InProcessTransport(Transport):
    def __init__(self, instance_id: str, fabric: Fabric = DEFAULT_FABRIC) -> None:
        self._name = f"{instance_id}#inproc{next(_agent_counter)}"
        self._fabric = fabric
        self._table: BlockTable | None = None
        self._peers: dict[str, BlockTable] = {}
        self._inbox = fabric.attach(self._name)

    @classmethod
    def create(cls, args: KVArgs, options: BackendOptions) -> InProcessTransport:
        """The backend's factory (``kv_transfer.backends``; no options): an agent on the default fabric."""
        return cls(args.instance_id)

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, table: BlockTable) -> None:
        self._table = table

    def metadata(self) -> bytes:
        return json.dumps({"agent": self._name}).encode()

    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        name = str(json.loads(metadata)["agent"])
        self._fabric.deliver(self._name, name, b"")  # reachability check, the analogue of a warm-up
        self._peers[name] = table
        return name

    def remove_peer(self, agent_name: str) -> None:
        self._peers.pop(agent_name, None)

    def post_write(self, peer: str, local_indices: np.ndarray, remote_indices: np.ndarray,
                   notif: bytes) -> object:
        if peer not in self._peers or not self._fabric.is_attached(peer) or self._table is None:
            raise TransportError(f"agent {peer} was not added or is gone")
        return self.post_write_spans(peer, self._table.spans(local_indices),
                                     self._peers[peer].spans(remote_indices), notif)

    def post_write_spans(self, peer: str, local_spans: np.ndarray, remote_spans: np.ndarray,
                         notif: bytes) -> object:
        if peer not in self._peers or not self._fabric.is_attached(peer) or self._table is None:
            raise TransportError(f"agent {peer} was not added or is gone")
        try:
            runs = merge_runs(local_spans, remote_spans)
        except ValueError as exc:
            raise TransportError(f"descriptors do not match between the two sides: {exc}") from exc
        for src_ptr, dst_ptr, nbytes in zip(runs.src_addrs.tolist(), runs.dst_addrs.tolist(),
                                            runs.nbytes.tolist()):
            ctypes.memmove(dst_ptr, src_ptr, nbytes)
        try:
            self._fabric.deliver(self._name, peer, notif)
        except TransportError:
            return XferState.ERR
        return XferState.DONE

    def check(self, handle: object) -> XferState:
        assert isinstance(handle, XferState)
        return handle

    def release(self, handle: object) -> None:
        pass

    def send_notif(self, peer: str, notif: bytes) -> None:
        self._fabric.deliver(self._name, peer, notif)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            sender, notif = self._inbox.popleft()
            if notif:
                out.append((sender, notif))
        return out

    def close(self) -> None:
        self._fabric.detach(self._name)
