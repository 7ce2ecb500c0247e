"""Mooncake transport (``mooncake-transfer-engine-non-cuda``): the only module that imports mooncake.

Facts it relies on (seen on loopback, docs/protocol.md "Mooncake"): ``P2PHANDSHAKE`` needs no metadata server,
a peer is addressed as ``host:rpc_port``; memory is registered once; a write counts as done when the peer
acknowledged that its bytes are in its memory (the TCP transport's acknowledged framing);
``transfer_submit_write`` submits one request as a batch of its own and returns 0 when it cannot (no
connection to the peer), ``transfer_check_status`` polls that batch without blocking (1 done, -1 failed: the
engine freed the batch; 0 under way); a dead peer fails a write at once, a stopped one never ends it, so a
write has a deadline of its own (``_timeout_s``, the rule of the engine's blocking calls). The engine's
blocking calls (``batch_transfer_sync_write``, ``get_batch_transfer_status``) poll the batch status in a loop
that never sleeps, a core for as long as a write lasts, which on two cores halved the transfer rate
(docs/multihost.md, "Figures"): they are used only for the zero-length write that carries a message, which
lasts one round trip (``transfer_sync`` with a ``TransferNotify`` delivers it to the peer's ``get_notifies``,
TCP included).

Threads: ``add_peer`` starts one writer thread per peer (``mc-write-<peer>``); ``remove_peer`` stops it
without waiting (the manager thread must not wait out a stopped peer), ``close`` joins every writer for at
most ``WRITER_STOP_S``. ``post_write`` only queues; the writer cuts the write's runs into pieces (at least one
per connection the engine keeps to the peer), keeps up to ``WINDOW`` in flight, polls them with sleeps
(``kv_transfer.poll.poll_interval_s``), then sends the write's notification, so a notification always follows
every byte of its write. ``send_notif`` queues behind the peer's writes too: it never blocks the manager
thread on a stopped peer. A failed write or message makes every write queued before the failure fail at once
(a stopped peer holds only its own writer, until one write's deadline, not once per queued write); later
writes try again. Messages queued behind the failure are dropped with them (logged): the protocol above asks
again for what it waits on (decode sends an unanswered cancel again, ``decode_side.CANCEL_RESEND_S``).
Mooncake reports a failed write to the writer only: the decode side learns it from the prefill side's
``abort`` message, or from the bootstrap (registration gone) and its waiting timeout when the prefill process
died.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kv_transfer import network, tcp_fence
from kv_transfer.aux import AUX_SLOT_BYTES
from kv_transfer.blocks import BlockTable, merge_runs
from kv_transfer.config import KVArgs
from kv_transfer.poll import poll_interval_s
from kv_transfer.transport import (
    BackendOptions,
    OptionError,
    PeerUnreachable,
    Transport,
    TransportError,
    XferState,
)

logger = logging.getLogger(__name__)
_agent_counter = itertools.count()

#: Pieces of one write in flight at once (each a one-request batch); the engine queues at most
#: ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024) per peer and refuses more.
WINDOW = 32
#: A write is cut into at least as many pieces as the engine has connections per peer
#: (``MC_TCP_LANES_PER_PEER``, 4 by default), none smaller than this, bytes: one connection carries one
#: piece at a time, so a single run would use one of them.
MIN_PIECE_BYTES = 1 << 20
#: How long the pieces of a failed write are polled for before they are forgotten, seconds.
ABANDONED_KEEP_S = 600.0
#: Mooncake settings this package chooses when the operator did not: a bounded per-transfer timeout (the
#: library's default, 30 s, is longer than a decode request waits). The one place it touches the environment.
MOONCAKE_DEFAULTS = {"MC_TRANSFER_TIMEOUT": "10"}
WRITER_STOP_S = 2.0
#: A batch or message that failed faster than this, seconds (a reset connection: the receiver fenced this
#: host, or a pooled connection went stale) is tried again, up to ``FAST_RETRIES`` times; a timeout is not.
#: Each such failure uses up one dead pooled connection (the engine keeps ``MC_TCP_LANES_PER_PEER``, 4, per
#: peer).
FAST_FAILURE_S = 1.0
FAST_RETRIES = 4
#: How long ``fence_incoming`` waits for the engine to close the connections it shut down, seconds.
FENCE_WAIT_S = 2.0
#: What ``MooncakeOptions.protocol`` may be: Mooncake's transfer-engine protocols this package runs.
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeOptions(BackendOptions):
    """Mooncake's options (model parameters ``kv_protocol``, ``kv_device``).

    Attributes:
        protocol: the transfer engine's protocol: ``"tcp"``, or ``"rdma"`` where RDMA NICs exist (Mooncake
            falls back to TCP without RDMA devices).
        device: RDMA NIC names for ``rdma``, comma-separated; empty: Mooncake picks.
    Raises:
        OptionError: a protocol outside ``PROTOCOLS``.
    """

    protocol: str = "tcp"
    device: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise OptionError("kv_protocol", f"must be one of {PROTOCOLS}, got {self.protocol!r}")


#: When a KV write's notification is delivered again, seconds after its first delivery. Mooncake sends a
#: write's notification once it sees the batch completed and, when that send fails (a link down at that
#: moment: its handshake socket's connect times out), logs "Failed to send notify message" and still reports
#: the batch completed, so ``transfer_sync`` returns 0 and the loss cannot be seen here: the decode's room
#: would wait out its waiting timeout (docs/multihost.md, "Limits"). The decode side ignores a chunk
#: notification it has seen, so the copies cost a zero-length write each and cover a blip of up to ~7 s.
RESEND_AFTER_S = (1.0, 3.0, 7.0)


@dataclass
class MooncakeWrite:
    """A posted write; ``state`` is written by the peer's writer thread, read by ``check``."""

    peer: str
    src_addrs: list[int]
    dst_addrs: list[int]
    nbytes: list[int]
    notif: bytes
    state: XferState = XferState.PROC
    queued_s: float = field(default_factory=time.monotonic)


@dataclass
class _Peer:
    endpoint: str                          # "host:rpc_port"
    table: BlockTable
    jobs: queue.SimpleQueue[MooncakeWrite | None] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    broken: str = ""                       # why the last delivery failed ("" once one succeeds again)
    failed_s: float = float("-inf")        # when it failed: writes queued before then fail without trying
    resends: list[tuple[float, bytes]] = field(default_factory=list)   # (due, notification), writer only


class MooncakeTransport(Transport):
    def __init__(self, instance_id: str, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "") -> None:
        """Cheap: the engine is created and initialised by ``register``. ``protocol`` "tcp" or "rdma"
        (``device_name``: RDMA NICs, comma-separated; Mooncake falls back to TCP without RDMA devices)."""
        self._name = f"{instance_id}#{os.getpid()}-{time.time_ns()}-{next(_agent_counter)}"
        self._hostname, self._protocol, self._device = hostname, protocol, device_name
        self._engine: Any = None           # mooncake.engine.TransferEngine (untyped extension module)
        self._table: BlockTable | None = None
        self._endpoint = ""
        self._peers: dict[str, _Peer] = {}
        self._endpoints: dict[str, str] = {}   # every peer ever added → "host:rpc_port" (kept after removal)
        self._data_ports: set[int] = set()     # the engine's TCP data listener(s): what peers write into
        self._registered: list[int] = []
        self._lanes = _lanes_per_peer()
        # pieces of failed writes still in flight: (batch id, since); every writer thread appends and reaps
        self._abandoned: list[tuple[int, float]] = []
        self._abandoned_lock = threading.Lock()

    @classmethod
    def create(cls, args: KVArgs, options: MooncakeOptions) -> MooncakeTransport:
        """The backend's factory (``kv_transfer.backends``): a transport advertising
        ``args.local_hostname``."""
        return cls(args.instance_id, args.local_hostname, options.protocol, options.device)

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, table: BlockTable) -> None:
        """Creates the engine and registers the KV region and the aux region, once. Raises
        ``TransportError``."""
        network.apply(MOONCAKE_DEFAULTS)
        for warning in network.reachability_warnings(self._hostname, environ={}):   # no UCX here
            logger.warning("%s: %s", self._name, warning)
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        listening = tcp_fence.listening_ports()
        if self._engine.initialize(self._hostname, "P2PHANDSHAKE", self._protocol, self._device) != 0:
            raise TransportError(f"mooncake initialize({self._hostname}, {self._protocol}) failed")
        self._endpoint = f"{self._hostname}:{self._engine.get_rpc_port()}"
        # the listeners the engine opened, but its RPC (handshake) one: where peers' writes arrive
        self._data_ports = tcp_fence.listening_ports() - listening - {int(self._engine.get_rpc_port())}
        regions = (*table.region_spans(),   # every rank's pool of a tensor-parallel instance
                   (table.aux_base_ptr, table.aux_slots * AUX_SLOT_BYTES))
        for addr, nbytes in regions:
            if self._engine.register_memory(addr, nbytes) != 0:
                raise TransportError(f"mooncake register_memory({addr:#x}, {nbytes}) failed")
            self._registered.append(addr)
        self._table = table

    def metadata(self) -> bytes:
        return json.dumps({"agent": self._name, "endpoint": self._endpoint}).encode()

    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        """Probes the peer's RPC endpoint and warms the connection up with an empty message (the first
        transfer to a peer pays a 5-8 ms handshake); starts its writer thread."""
        try:
            info = json.loads(metadata)
            name, endpoint = str(info["agent"]), str(info["endpoint"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"bad mooncake peer metadata: {exc!r}") from exc
        if self._engine.send_probe(endpoint) != 0:
            raise PeerUnreachable(f"mooncake peer {name} at {endpoint} does not answer (its advertised "
                                  "address must be reachable from here: docs/multihost.md)")
        if not self._deliver(endpoint, b"hello"):
            raise PeerUnreachable(f"mooncake warm-up message to {name} at {endpoint} failed")
        self.remove_peer(name)
        self._endpoints[name] = endpoint
        peer = _Peer(endpoint, table)
        peer.thread = threading.Thread(target=self._write_loop, args=(name, peer), daemon=True,
                                       name=f"mc-write-{name.split('#')[0]}")
        self._peers[name] = peer
        peer.thread.start()
        return name

    def remove_peer(self, agent_name: str) -> None:
        """Never blocks: the peer's queued writes fail now; a write under way (a stopped peer: up to
        ``MC_TRANSFER_TIMEOUT``) ends on the writer thread, which then exits."""
        peer = self._peers.pop(agent_name, None)
        if peer is not None:
            self._stop_writer(peer)

    def post_write(self, peer: str, local_indices: np.ndarray, remote_indices: np.ndarray,
                   notif: bytes) -> object:
        target = self._peers.get(peer)
        if target is None or self._table is None:
            raise TransportError(f"agent {peer} was not added")
        return self.post_write_spans(peer, self._table.spans(local_indices),
                                     target.table.spans(remote_indices), notif)

    def post_write_spans(self, peer: str, local_spans: np.ndarray, remote_spans: np.ndarray,
                         notif: bytes) -> object:
        target = self._peers.get(peer)
        if target is None or self._table is None:
            raise TransportError(f"agent {peer} was not added")
        try:
            runs = merge_runs(local_spans, remote_spans)
        except ValueError as exc:
            raise TransportError(str(exc)) from exc
        write = MooncakeWrite(peer, runs.src_addrs.tolist(), runs.dst_addrs.tolist(), runs.nbytes.tolist(),
                              notif)
        target.jobs.put(write)
        return write

    def check(self, handle: object) -> XferState:
        assert isinstance(handle, MooncakeWrite)
        return handle.state

    def release(self, handle: object) -> None:
        pass

    def send_notif(self, peer: str, notif: bytes) -> None:
        """Queued behind the peer's writes (never blocks); raises ``TransportError`` for an unknown peer. A
        failed delivery is logged (the peer's death reaches the manager through the bootstrap)."""
        target = self._peers.get(peer)
        if target is None:
            raise TransportError(f"agent {peer} was not added")
        target.jobs.put(MooncakeWrite(peer, [], [], [], notif))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        if self._engine is None:
            return []
        # messages travel as str (pybind); latin-1 maps bytes 1:1 both ways
        return [(str(n.name), str(n.msg).encode("latin-1")) for n in self._engine.get_notifies()
                if n.msg and n.msg != "hello"]

    def fence_incoming(self, peer: str) -> bool:
        """Shuts down the connections the engine accepted from ``peer``'s host on its data port and waits (up
        to ``FENCE_WAIT_S``) until the engine closed them (``tcp_fence.fence_host``): a write the peer gave up
        on can then no longer land here. Every peer on that host loses its pooled connections too; their next
        writes fail at once and are tried again (``FAST_RETRIES``) until one gets a new connection. True when
        fenced; a peer never added here: True (no connection of ours carries its writes). Manager thread,
        without the transport lock."""
        endpoint = self._endpoints.get(peer)
        if endpoint is None:
            return True
        host = endpoint.rsplit(":", 1)[0]
        return tcp_fence.fence_host(self._data_ports, host, FENCE_WAIT_S)

    def close(self) -> None:
        """Stops the writers, unregisters the memory, drops the engine. A writer still inside a transfer after
        ``WRITER_STOP_S`` (a stopped peer), or a piece of a failed write still in flight, keeps the engine
        alive: tearing it down under a running transfer could crash the process; a write ends at its deadline
        (``_timeout_s``)."""
        busy = [peer.thread for peer in self._peers.values() if peer.thread is not None]
        for name in list(self._peers):
            self.remove_peer(name)
        deadline_s = time.monotonic() + WRITER_STOP_S
        for thread in busy:
            thread.join(max(0.0, deadline_s - time.monotonic()))
        if self._engine is None:
            return
        if any(thread.is_alive() for thread in busy):
            logger.warning("mooncake transport %s closed with a writer still busy: engine left alive",
                           self._name)
            return
        if self._reap():
            logger.warning("mooncake transport %s closed with pieces of a failed write in flight: engine "
                           "left alive", self._name)
            return
        for addr in self._registered:
            if self._engine.unregister_memory(addr) != 0:
                logger.warning("mooncake unregister_memory(%#x) failed", addr)
        self._registered = []
        self._engine = None   # the last reference: the engine's threads and sockets go now

    # --- writer threads ---------------------------------------------------------------------------------
    def _write_loop(self, name: str, peer: _Peer) -> None:
        """The writer of one peer, until ``peer.stop``. A write queued while the peer was failing (a stopped
        peer takes ``MC_TRANSFER_TIMEOUT`` per batch) fails without trying, so a backlog never adds up."""
        while not peer.stop.is_set():
            self._resend_due(peer)
            wait_s = 0.5 if not peer.resends else min(0.5, max(0.0, peer.resends[0][0] - time.monotonic()))
            try:
                write = peer.jobs.get(timeout=wait_s)
            except queue.Empty:
                continue
            if write is None:
                continue
            if write.queued_s < peer.failed_s:
                write.state = XferState.ERR
                if not write.nbytes and write.notif:
                    logger.info("mooncake: a message to %s queued before its last failure dropped", name)
                continue
            if self._run(peer, write):
                write.state, peer.broken = XferState.DONE, ""
                if write.notif and write.nbytes:   # a KV write's notification: see RESEND_AFTER_S
                    now_s = time.monotonic()
                    peer.resends.extend((now_s + delay_s, write.notif) for delay_s in RESEND_AFTER_S)
                    peer.resends.sort(key=lambda due: due[0])
                continue
            write.state, peer.failed_s = XferState.ERR, time.monotonic()
            peer.broken = "a write or message to it failed"
            logger.warning("mooncake write to %s at %s failed", name, peer.endpoint)

    def _resend_due(self, peer: _Peer) -> None:
        """Delivers again the notifications whose time came (``RESEND_AFTER_S``); a failure is only logged
        (the peer's own writes decide whether it is failing). The peer's writer thread."""
        now_s = time.monotonic()
        while peer.resends and peer.resends[0][0] <= now_s and not peer.stop.is_set():
            _, notif = peer.resends.pop(0)
            if not self._deliver(peer.endpoint, notif):
                logger.debug("mooncake: a repeated notification to %s failed", peer.endpoint)

    def _run(self, peer: _Peer, write: MooncakeWrite) -> bool:
        """Writes ``write``'s runs, then its notification; True when every byte and the message went. Each
        piece (``_pieces``) is a one-request batch of its own (``transfer_submit_write``), polled with
        ``transfer_check_status``, at most ``WINDOW`` in flight: the engine's own blocking calls poll the
        batch status in a loop that never sleeps, a core for as long as the write lasts. Fails at
        ``_timeout_s`` (the library's sync rule); pieces still in flight then are handed to ``_abandon``."""
        self._reap()
        pieces = _pieces(write.src_addrs, write.dst_addrs, write.nbytes, self._lanes)
        started_s = time.monotonic()
        deadline_s = started_s + _timeout_s(sum(write.nbytes))
        in_flight: dict[int, tuple[int, float, int]] = {}     # batch id -> (piece, submitted at, tries)
        next_piece = 0
        while next_piece < len(pieces) or in_flight:
            while next_piece < len(pieces) and len(in_flight) < WINDOW:
                if not self._submit(peer, pieces, next_piece, 1, in_flight):
                    return self._abandon(in_flight)
                next_piece += 1
            for batch_id, (piece, submitted_s, tries) in list(in_flight.items()):
                status = self._engine.transfer_check_status(batch_id)
                if status == 0:
                    continue
                del in_flight[batch_id]
                if status == 1:
                    continue
                if status == -2:      # timed out inside the engine: not freed, keep polling it elsewhere
                    self._abandon({batch_id: (piece, submitted_s, tries)})
                failed_in_s = time.monotonic() - submitted_s
                if failed_in_s >= FAST_FAILURE_S or tries > FAST_RETRIES:
                    return self._abandon(in_flight)
                logger.info("mooncake: a write failed in %.0f ms; trying it again", failed_in_s * 1e3)
                if not self._submit(peer, pieces, piece, tries + 1, in_flight):
                    return self._abandon(in_flight)
            if not in_flight and next_piece == len(pieces):
                break
            now_s = time.monotonic()
            if now_s > deadline_s:
                logger.warning("mooncake: a write to %s timed out after %.1f s", peer.endpoint,
                               now_s - started_s)
                return self._abandon(in_flight)
            time.sleep(poll_interval_s(now_s - started_s))
        return not write.notif or self._deliver(peer.endpoint, write.notif)

    def _submit(self, peer: _Peer, pieces: list[tuple[int, int, int]], piece: int, tries: int,
                in_flight: dict[int, tuple[int, float, int]]) -> bool:
        """Submits ``pieces[piece]`` into ``in_flight``; a refused submit (no connection to the peer, a full
        lane queue) is tried again at once up to ``FAST_RETRIES`` times. False when it never went."""
        src, dst, nbytes = pieces[piece]
        for attempt in range(tries, FAST_RETRIES + 2):
            batch_id = self._engine.transfer_submit_write(peer.endpoint, src, dst, nbytes)
            if batch_id:
                in_flight[batch_id] = (piece, time.monotonic(), attempt)
                return True
        return False

    def _abandon(self, in_flight: dict[int, tuple[int, float, int]]) -> bool:
        """A write failed: its pieces still in flight are polled later (``_reap``) so that the engine frees
        them once they end, and ``close`` keeps the engine while any is in flight; returns False."""
        now_s = time.monotonic()
        with self._abandoned_lock:
            self._abandoned.extend((batch_id, now_s) for batch_id in in_flight)
        in_flight.clear()
        return False

    def _reap(self) -> int:
        """Polls the pieces of failed writes once: an ended one is freed by the engine; one still in flight
        after ``ABANDONED_KEEP_S`` is forgotten (its batch descriptor leaks, logged). Returns how many are
        still in flight. Any writer thread, or ``close``."""
        now_s, kept = time.monotonic(), []
        with self._abandoned_lock:
            for batch_id, since_s in self._abandoned:
                if self._engine.transfer_check_status(batch_id) in (1, -1):
                    continue
                if now_s - since_s > ABANDONED_KEEP_S:
                    logger.warning("mooncake: a transfer still in flight after %.0f s: forgotten",
                                   now_s - since_s)
                    continue
                kept.append((batch_id, since_s))
            self._abandoned = kept
        return len(kept)

    def _deliver(self, endpoint: str, message: bytes) -> bool:
        from mooncake.engine import TransferNotify, TransferOpcode

        table = self._table
        assert table is not None
        notify = TransferNotify(self._name, message.decode("latin-1"))
        # a zero-length write: nothing lands, the message does (after every earlier write of this thread)
        return _retry_fast_failures(lambda: self._engine.transfer_sync(
            endpoint, table.aux_base_ptr, 0, 0, TransferOpcode.Write, notify) == 0)

    def _stop_writer(self, peer: _Peer) -> None:
        peer.stop.set()
        peer.jobs.put(None)   # wakes the writer
        while True:   # writes never run fail: their rooms must not wait for them
            try:
                left = peer.jobs.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                left.state = XferState.ERR


def _retry_fast_failures(attempt: Callable[[], bool]) -> bool:
    """``attempt()``, tried again up to ``FAST_RETRIES`` times while it fails within ``FAST_FAILURE_S`` (a
    reset connection, which the engine drops and replaces on the next try). Safe for a write: each try writes
    the same bytes to the same addresses, which still belong to its room (the decode side frees a room's pages
    only after the writer reported the room, and fences first if a write of it failed)."""
    for _ in range(FAST_RETRIES):
        t0_s = time.monotonic()
        if attempt():
            return True
        failed_in_s = time.monotonic() - t0_s
        if failed_in_s >= FAST_FAILURE_S:
            return False
        logger.info("mooncake: a write failed in %.0f ms; trying it again", failed_in_s * 1e3)
    return attempt()


def _lanes_per_peer() -> int:
    """The engine's connections per peer: ``MC_TCP_LANES_PER_PEER`` (as the engine reads it), default 4."""
    try:
        return max(1, int(network.library_setting("MC_TCP_LANES_PER_PEER", "4")))
    except ValueError:
        return 4


def _timeout_s(nbytes: int) -> float:
    """A write's deadline, seconds: ``MC_TRANSFER_TIMEOUT`` (at least 5, as the engine's Python binding reads
    it) plus a second per GiB, the rule of the engine's own blocking calls."""
    try:
        base_s = max(5, int(network.library_setting("MC_TRANSFER_TIMEOUT",
                                                    MOONCAKE_DEFAULTS["MC_TRANSFER_TIMEOUT"])))
    except ValueError:
        base_s = 5     # the binding's atoi reads 0; max(5, 0)
    return base_s + nbytes / (1 << 30)


def _pieces(src_addrs: list[int], dst_addrs: list[int], nbytes: list[int],
            lanes: int) -> list[tuple[int, int, int]]:
    """``(src, dst, nbytes)`` of each piece a write goes as: its runs in order, a run longer than the piece
    size cut in consecutive pieces. Piece size: the write's bytes over ``lanes``, at least
    ``MIN_PIECE_BYTES`` (a single 180 MiB run goes as 4 pieces of 45 MiB, one per connection)."""
    piece_bytes = max(MIN_PIECE_BYTES, -(-sum(nbytes) // max(1, lanes)))
    out = []
    for src, dst, size in zip(src_addrs, dst_addrs, nbytes):
        for offset in range(0, size, piece_bytes):
            out.append((src + offset, dst + offset, min(piece_bytes, size - offset)))
    return out
