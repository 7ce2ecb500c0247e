"""The byte-moving seam under a KV manager: one-sided WRITEs plus small notifications between agents.

Three implementations pass the same contract tests: ``NixlTransport`` (UCX over NIXL; host or GPU memory),
``MooncakeTransport`` (Mooncake's transfer engine; TCP, RDMA by configuration) and ``InProcessTransport``
(memmove between managers living in one process).

Threading: an implementation does no locking of its own. The manager wraps it in ``LockedTransport``, which
serialises every call, because two threads use it: the manager's background thread, and with
``KVArgs.inline_progress`` the callers of ``send`` (which post WRITEs) and of ``poll`` (which drain
notifications). NIXL agents need no more than that: calls on one agent must not overlap. Those callers'
threads (engine loops) never wait behind a handshake (``LockedTransport.held_unless_handshaking``): a first
handshake with a peer across the network can hold the agent for seconds, and every request of the instance
would stall behind that one peer; they leave their work to the manager thread instead.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from kv_transfer.blocks import BlockTable

#: descriptor indices ``[n]`` and (address, nbytes) spans ``[n, 2]`` of a WRITE
Int64Array = npt.NDArray[np.int64]


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


class OptionError(ValueError):
    """A backend option has a value its backend refuses.

    Attributes:
        param: the option's model parameter name (``kv_<field>``, as written in ``config.pbtxt``), or the
            environment variable its bad value came from.
        reason: what is wrong with its value.
    """

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"KV backend option {param!r}: {reason}")
        self.param = param
        self.reason = reason


_Options = TypeVar("_Options", bound="BackendOptions")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class BackendOptions:
    """The options one KV backend owns, next to its ``Transport`` (a backend with none uses this class).

    A subclass is a frozen dataclass of ``bool``, ``int``, ``float`` and ``str`` fields with defaults; field
    ``f`` is the model parameter ``kv_<f>`` of ``config.pbtxt`` (serving reads a backend's own parameters and
    passes the rest of the model's parameters to nobody), and ``ENV`` names the environment variables that
    override a field (``{"network_only": "PD_KV_NETWORK_ONLY"}``). A subclass checks its values in
    ``__post_init__`` and raises ``OptionError`` naming the parameter.
    """

    ENV: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def parameters(cls) -> tuple[str, ...]:
        """The model parameters this backend owns: ``kv_<field>`` for each field, in field order."""
        return tuple(f"kv_{f.name}" for f in fields(cls))

    @classmethod
    def parse(cls: type[_Options], parameters: Mapping[str, str],
              environ: Mapping[str, str] | None = None) -> _Options:
        """The options from model parameters (``{"kv_protocol": "rdma"}``: only the names in ``parameters()``
        are read, others are ignored) and ``environ`` (``ENV`` overrides a parameter when set and not empty;
        None: no environment). Raises ``OptionError`` for a value that does not parse (naming the parameter,
        or the environment variable it came from) or that ``__post_init__`` refuses."""
        values: dict[str, Any] = {}
        env = environ or {}
        for f in fields(cls):
            source = cls.ENV.get(f.name, "")        # the environment variable first, when set
            text = env.get(source, "").strip() if source else ""
            if not text:
                source = f"kv_{f.name}"
                text = parameters.get(source, "").strip()
            if text:
                values[f.name] = _parse_option(source, f.type if isinstance(f.type, str) else f.type.__name__,
                                               text)
        return cls(**values)


def _parse_option(param: str, kind: str, text: str) -> object:
    """One option's text as its field's type (``"bool"``, ``"int"``, ``"float"``, ``"str"``); raises
    ``OptionError``."""
    if kind == "bool":
        if text.lower() not in _TRUE + _FALSE:
            raise OptionError(param,
                              f"must be a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {text!r}")
        return text.lower() in _TRUE
    try:
        return int(text) if kind == "int" else float(text) if kind == "float" else text
    except ValueError:
        raise OptionError(param,
                          f"must be a{'n int' if kind == 'int' else ' number'}, got {text!r}") from None


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
    def post_write(self, peer: str, local_indices: Int64Array, remote_indices: Int64Array,
                   notif: bytes) -> object:
        """Posts one WRITE of local descriptors ``local_indices`` into the peer's ``remote_indices`` (int64,
        same length, index spaces of the two ``BlockTable``s; descriptor sizes match pairwise).

        ``notif`` is delivered to the peer after every byte of this write has landed. Returns a handle for
        ``check``/``release``. The local bytes must stay untouched until ``check`` says DONE or ERR.
        Raises ``TransportError`` (nothing was posted)."""

    @abstractmethod
    def post_write_spans(self, peer: str, local_spans: Int64Array, remote_spans: Int64Array,
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

    def fence_incoming(self, peer: str) -> bool:
        """Makes sure no byte of a write ``peer`` started before this call can land in our registered memory
        any more: True once that holds, False when it does not hold yet (call again later). Called by the
        decode side's manager thread before it frees the pages of a room whose writer reported a failed write
        or vanished (``KVReceiver.fence_needed``); not under the transport lock (it may wait, up to ~2 s).

        This default (NIXL, in-process): True at once. In-process copies are synchronous; NIXL over UCX has no
        transfer timeout of its own (a transfer fails when its endpoint does), and no late write was seen
        from it in the partition tests. Mooncake over TCP, which gives writes up on a timeout, overrides it:
        docs/multihost.md "Late writes after a partition"."""
        return True


class LockedTransport(Transport):
    """Every call of the wrapped transport under one lock. Callers must not hold it while taking the
    manager lock: the lock order is manager lock, then this one (this one is never held across a call
    back into the manager), and ``held_unless_handshaking``'s holder takes the manager lock only after its
    block."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self._lock = threading.RLock()   # reentrant: calls inside ``held_unless_handshaking`` take it again
        self._handshake_lock = threading.Lock()   # guards ``_handshakes``; never held while waiting for
                                                  # the other
        self._handshakes = 0   # ``add_peer`` calls announced or running

    @contextmanager
    def held_unless_handshaking(self) -> Iterator[bool]:
        """``with transport.held_unless_handshaking() as held:``: False, at once, while an ``add_peer`` runs
        or waits for the lock (a first handshake: seconds across hosts); else True, with the lock this
        thread's until the block ends (waiting only for a call in progress), so the transport's calls inside
        it go through. For callers on engine threads (inline progress): on False they leave the work to the
        manager thread. No manager lock inside the block (the order above). Race-free: ``add_peer`` announces
        itself under ``_handshake_lock`` before it waits for the lock, and this takes the lock under the same
        one."""
        with self._handshake_lock:
            held = self._handshakes == 0
            if held:
                self._lock.acquire()
        try:
            yield held
        finally:
            if held:
                self._lock.release()

    @property
    def handshaking(self) -> bool:
        """Whether an ``add_peer`` is announced or running: a snapshot without any lock, for a caller's cheap
        early check (``PrefillSide.post_now`` leaves its chunks queued at once); ``held_unless_handshaking``
        is the race-free one."""
        return self._handshakes > 0

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
        with self._handshake_lock:
            self._handshakes += 1
        try:
            with self._lock:
                return self._inner.add_peer(metadata, table)
        finally:
            with self._handshake_lock:
                self._handshakes -= 1

    def remove_peer(self, agent_name: str) -> None:
        with self._lock:
            self._inner.remove_peer(agent_name)

    def post_write(self, peer: str, local_indices: Int64Array, remote_indices: Int64Array,
                   notif: bytes) -> object:
        with self._lock:
            return self._inner.post_write(peer, local_indices, remote_indices, notif)

    def post_write_spans(self, peer: str, local_spans: Int64Array, remote_spans: Int64Array,
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

    def fence_incoming(self, peer: str) -> bool:
        # not under the lock: it may wait for sockets to close (seconds), and engine threads need the lock
        return self._inner.fence_incoming(peer)
