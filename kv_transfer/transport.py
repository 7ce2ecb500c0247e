"""The byte-moving seam under a KV manager: one-sided WRITEs plus small notifications between agents.

Two implementations pass the same contract tests: ``NixlTransport`` (UCX over NIXL; host or GPU memory) and
``InProcessTransport`` (memmove between managers living in one process).

Threading: a transport is used by exactly one thread after ``start`` (the manager's background thread);
it does no locking of its own.
"""

from __future__ import annotations

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
        Raises ``TransportError``."""

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
