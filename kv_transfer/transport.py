"""The byte-moving seam under a KV manager: one-sided WRITEs plus small notifications between agents.

Three implementations pass the same contract tests: ``NixlTransport`` (UCX over NIXL; host or GPU memory),
``MooncakeTransport`` (Mooncake's transfer engine; TCP, RDMA by configuration) and ``InProcessTransport`` (memmove
between managers living in one process).

Threading: an implementation does no locking of its own. The manager wraps it in ``LockedTransport``, which
serialises every call, because two threads use it: the manager's background thread, and with
``KVArgs.inline_progress`` the callers of ``send`` (which post WRITEs) and of ``poll`` (which drain
notifications). NIXL agents need no more than that: calls on one agent must not overlap.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from enum import Enum

import numpy as np

from kv_transfer.blocks import BlockTable


class XferState(str, Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransportError(Exception):
    """A transport call failed (peer unreachable or dead, unknown agent, backend error)."""


class PeerUnreachable(TransportError):
    """The transport cannot connect to a peer with this instance's configuration (no common transport, no
    route, the peer's address refuses). Permanent for the rooms that wanted that peer: they fail at once with
    this message; a later room tries the handshake again. The message names the cause and the settings."""


class Transport(ABC):
    """Owns one agent and its registered regions."""

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """Unique per process start (peers detect restarts by a changed name)."""

    @abstractmethod
    def register(self, table: BlockTable) -> None:
        """Caller: the manager's ``start``, once. Registers the KV and aux regions of ``table`` (and prepares
        its descriptor list); the caller keeps that memory alive until ``close``."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer``; valid after ``register``."""

    @abstractmethod
    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        """Loads a peer's metadata, prepares its descriptor list ``table``, warms the connection up;
        returns its agent name. Called once per peer (again only after it restarted).
        Raises ``PeerUnreachable`` (no connection possible: fail the rooms that wanted it) or
        ``TransportError`` (anything else)."""

    @abstractmethod
    def remove_peer(self, agent_name: str) -> None:
        """Forgets a peer (it restarted or died). Never raises."""

    @abstractmethod
    def post_write(self, peer: str, local_indices: np.ndarray, remote_indices: np.ndarray,
                   notif: bytes) -> object:
        """Posts one WRITE of local descriptors ``local_indices`` into the peer's ``remote_indices`` (int64,
        same length, index spaces of the two ``BlockTable``s; descriptor sizes match pairwise).

        ``notif`` is delivered to the peer after every byte of this write has landed. Returns a handle for
        ``check``/``release``. The local bytes must stay untouched until ``check`` says DONE or ERR.
        Raises ``TransportError`` (nothing was posted)."""

    @abstractmethod
    def post_write_spans(self, peer: str, local_spans: np.ndarray, remote_spans: np.ndarray,
                         notif: bytes) -> object:
        """Posts one WRITE of explicit spans: int64 ``[n, 2]`` (address, nbytes) each, pairwise equal sizes,
        every span inside the regions ``register`` (here) and ``add_peer`` (there) covered; for what the
        descriptor index space cannot name (a prompt's partly filled last page). Same contract as
        ``post_write`` otherwise. Raises ``TransportError`` (nothing was posted)."""

    @abstractmethod
    def check(self, handle: object) -> XferState:
        """Non-blocking progress check of a posted write; ERR means the peer may have got part of it."""

    @abstractmethod
    def release(self, handle: object) -> None:
        """Frees a handle whose state is DONE or ERR."""

    @abstractmethod
    def send_notif(self, peer: str, notif: bytes) -> None:
        """Sends a small message to ``peer``. Raises ``TransportError``."""

    @abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Drains and returns the (sender agent name, message) pairs that arrived since the last call."""

    @abstractmethod
    def close(self) -> None:
        """Releases the agent; called once by ``shutdown``."""


class LockedTransport(Transport):
    """Every call of the wrapped transport under one lock. Callers must not hold it while taking the
    manager lock: the lock order is manager lock, then this one (this one is never held across a call
    back into the manager)."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self._lock = threading.Lock()

    @property
    def agent_name(self) -> str:
        return self._inner.agent_name

    def register(self, table: BlockTable) -> None:
        with self._lock:
            self._inner.register(table)

    def metadata(self) -> bytes:
        with self._lock:
            return self._inner.metadata()

    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        with self._lock:
            return self._inner.add_peer(metadata, table)

    def remove_peer(self, agent_name: str) -> None:
        with self._lock:
            self._inner.remove_peer(agent_name)

    def post_write(self, peer: str, local_indices: np.ndarray, remote_indices: np.ndarray,
                   notif: bytes) -> object:
        with self._lock:
            return self._inner.post_write(peer, local_indices, remote_indices, notif)

    def post_write_spans(self, peer: str, local_spans: np.ndarray, remote_spans: np.ndarray,
                         notif: bytes) -> object:
        with self._lock:
            return self._inner.post_write_spans(peer, local_spans, remote_spans, notif)

    def check(self, handle: object) -> XferState:
        with self._lock:
            return self._inner.check(handle)

    def release(self, handle: object) -> None:
        with self._lock:
            self._inner.release(handle)

    def send_notif(self, peer: str, notif: bytes) -> None:
        with self._lock:
            self._inner.send_notif(peer, notif)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return self._inner.get_notifs()

    def close(self) -> None:
        with self._lock:
            self._inner.close()
