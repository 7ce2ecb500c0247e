"""One KV manager per engine instance: owns the transport agent, the registered regions, the instance's own
rendezvous (``bootstrap.rendezvous``: its registration, and on prefill the rooms decode posts to it) and the
one background thread that does the transfer work (with ``KVArgs.inline_progress``, ``send`` posts its WRITE
and ``poll`` drains notifications in the caller's thread; the thread does the rest).

Threads: ``start()`` starts the thread ``kv-<role>-<instance>``; it loops until ``shutdown()`` sets the stop
event, each round: the role's tick (bootstrap polling, handshakes, notification draining, transfer polling,
timeouts, cleanup), then a wait on the wake event (set by sender/receiver calls, and by the rendezvous when a
destination arrives) with a timeout, so timeouts and cleanup also run when no new work arrives. The role's
tick is told whether the event was set since the last round (the decode side keeps rounds nobody woke cheap;
the prefill side takes new destinations at once). A second thread, ``kv-heartbeat-<instance>``, reports the
instance's load every ``heartbeat_interval_s`` (what routers read as "this instance answers"): a round that
waits on one peer (a first handshake across hosts, an HTTP call to a partitioned peer: seconds) must not make
the whole instance look dead to every router, which would give up its other requests and open its breaker. It
stops reporting when a round has run for ``MANAGER_STALL_S``: a manager thread stuck for good lets the
registration expire, so routers stop choosing the instance.
Shutdown order: stop the thread, fail open rooms and tell the peers, deregister and stop the rendezvous, close
the agent. The caller keeps the KV memory alive until ``shutdown()`` returned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from bootstrap.client import ClientPool
from bootstrap.messages import InstanceLoad, Registration
from bootstrap.rendezvous import Rendezvous, RendezvousConfig
from kv_transfer.auxbuf import AuxBuffer
from kv_transfer.base import BaseKVManager
from kv_transfer.blocks import BlockTable
from kv_transfer.config import KVArgs
from kv_transfer.decode_side import DecodeSide
from kv_transfer.layout import compat_hash
from kv_transfer.peers import PeerTable, kv_info
from kv_transfer.prefill_side import PrefillSide
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, Room
from kv_transfer.transport import LockedTransport, Transport

logger = logging.getLogger(__name__)

#: Longest wait of ``shutdown`` for open rooms (WRITEs in flight, peers' acknowledgements), seconds.
SHUTDOWN_ROOMS_S = 2.0
#: A manager round running this long stops the load reports (the registration then expires), seconds: well
#: over any one peer call (HTTP calls time out after ``KVArgs.http_timeout_s``, 2 s; a first handshake across
#: hosts took ~5 s in the worst run seen), under a bootstrap timeout (30 s).
MANAGER_STALL_S = 20.0


class KVManager(BaseKVManager):
    """Constructed cheaply (no threads, no I/O); ``start`` does the work. Thread-safe public methods."""

    def __init__(self, args: KVArgs, transport: Transport) -> None:
        self.args = args
        self._transport = LockedTransport(transport)   # the caller's threads use it too
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._aux = AuxBuffer(args.aux_slots)
        self._rendezvous = Rendezvous(RendezvousConfig(host=args.local_hostname, port=args.rendezvous_port,
                                                       secret=args.fleet_secret, tls=args.fleet_tls),
                                      on_destination=self._wake.set)
        self._clients = ClientPool(args.http_timeout_s, args.fleet_secret, args.fleet_tls)
        self._peers = PeerTable(self._clients, self._transport, args.model_id, args.layout, args.peer_lost_s)
        self._side: PrefillSide | DecodeSide | None = None   # built in start(): decode needs our
                                                             # rendezvous URL
        self.epoch = 0
        self._heartbeats: threading.Thread | None = None
        self._round_started_s: float | None = None   # set while a manager round runs (a float write: atomic)
        self._stall_logged = False
        self._load: Callable[[], InstanceLoad | None] = lambda: None
        self._draining = False

    def set_load_source(self, load: Callable[[], InstanceLoad | None]) -> None:
        """``load()`` is called on the heartbeat thread before every heartbeat; what it returns travels with
        the heartbeat (the router pairs by it). It must be cheap and thread-safe (read a snapshot). Call
        before ``start``."""
        self._load = load

    @property
    def agent_name(self) -> str:
        return self._transport.agent_name

    @property
    def rendezvous_url(self) -> str:
        """``http://host:port`` (``https://`` with TLS) of this instance's rendezvous (after ``start``): what
        routers pass to decode."""
        return self._rendezvous.url

    def start(self) -> None:
        """Registers the KV and aux regions with the transport, starts the rendezvous server and registers
        there, starts the thread.

        Raises ``BootstrapError`` when the rendezvous cannot listen (address in use or not this host's; a
        non-loopback address without a fleet secret)."""
        if self._thread is not None:
            raise RuntimeError("KVManager.start called twice")
        self._transport.register(BlockTable(
            self.args.kv_base_ptr, self.args.layout, self._aux.base_ptr, self.args.aux_slots,
            self.args.kv_regions))
        self._rendezvous.start(name=f"rendezvous-{self.args.instance_id}")
        if self.args.role == "prefill":
            self._side = PrefillSide(self.args, self._transport, self._rendezvous, self._peers, self._aux,
                                     self._lock)
        else:
            self._side = DecodeSide(self.args, self._transport, self._clients, self._peers, self._aux,
                                    self._lock, self._rendezvous.url)
        self.epoch = time.time_ns()
        self._register()
        self._thread = threading.Thread(target=self._run, name=f"kv-{self.args.role}-{self.args.instance_id}",
                                        daemon=True)
        self._thread.start()
        self._heartbeats = threading.Thread(target=self._heartbeat_loop,
                                            name=f"kv-heartbeat-{self.args.instance_id}", daemon=True)
        self._heartbeats.start()
        logger.info("kv manager %s (%s) started, agent %s, rendezvous %s", self.args.instance_id,
                    self.args.role, self.agent_name, self._rendezvous.url)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Idempotent. Stops the thread, fails open rooms (peers are told), deregisters and stops the
        rendezvous, closes the agent."""
        if self._thread is None or self._side is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._heartbeats is not None:
            self._heartbeats.join(timeout_s)
            self._heartbeats = None
        # open rooms get at most SHUTDOWN_ROOMS_S for their WRITEs and the peers' answers: at a server stop
        # every instance shuts down at once, so no peer answers and a longer wait only holds the server's exit
        self._side.shutdown(time.monotonic() + min(timeout_s / 2, SHUTDOWN_ROOMS_S), time.monotonic)
        self._rendezvous.deregister(self.args.instance_id, self.epoch)
        self._rendezvous.stop()
        self._transport.close()
        self._clients.close()
        self._thread = None

    def create_sender(self, room: Room) -> KVSender:
        """Prefill role only: the sender of room ``room`` (Failed at once if the room is open here
        already)."""
        if not isinstance(self._side, PrefillSide):
            raise TypeError("create_sender on a decode manager (or before start)")
        sender = self._side.create_sender(room, self._wake, time.monotonic())
        self._wake.set()
        return sender

    def create_receiver(self, room: Room, prefill_instance_id: str,
                        prefill_rendezvous_url: str) -> KVReceiver:
        """Decode role only: the receiver of room ``room``, fed by ``prefill_instance_id``, whose rendezvous
        is at ``prefill_rendezvous_url``."""
        if not isinstance(self._side, DecodeSide):
            raise TypeError("create_receiver on a prefill manager (or before start)")
        receiver = self._side.create_receiver(room, prefill_instance_id, prefill_rendezvous_url, self._wake,
                                              time.monotonic())
        self._wake.set()
        return receiver

    def metrics(self) -> dict[str, int]:
        with self._lock:
            if self._side is None:
                return {}
            out = self._side.metrics.as_dict()
            out["open_rooms"] = self._side.open_rooms
            out["free_aux_slots"] = self._aux.num_free
            out["peer_handshakes_total"] = self._peers.handshakes_total
            return out

    def _registration(self) -> Registration:
        return Registration(
            instance_id=self.args.instance_id, role=self.args.role, epoch=self.epoch,
            agent_name=self._transport.agent_name,
            agent_metadata_b64=Registration.encode_metadata(self._transport.metadata()),
            compat_hash=compat_hash(self.args.model_id, self.args.layout, bool(self.args.kv_regions)),
            address=self.args.address,
            kv_info=kv_info(self.args.model_id, self.args.layout, self.args.kv_base_ptr, self._aux.base_ptr,
                            self.args.aux_slots, self.args.kv_regions),
            model_name=self.args.model_name, load=self._load() or InstanceLoad(),
            rendezvous_url=self._rendezvous.url, worker_endpoint=self.args.worker_endpoint)

    def _run(self) -> None:
        while not self._stop.is_set():
            # cleared before the round, not after the wait: a wake-up set during the round is kept
            woken = self._wake.is_set()
            self._wake.clear()
            now_s = time.monotonic()
            wait_s = self.args.idle_tick_s
            self._round_started_s = now_s
            try:
                assert self._side is not None
                wait_s = self._side.tick(now_s, woken)
            except Exception:
                logger.exception("kv manager %s: tick failed", self.args.instance_id)
            finally:
                self._round_started_s = None
            self._wake.wait(wait_s)

    def _heartbeat_loop(self) -> None:
        """The heartbeat thread: a load report every ``heartbeat_interval_s`` until ``shutdown``, none while
        the manager's current round has run for ``MANAGER_STALL_S`` (module docstring)."""
        while not self._stop.wait(self.args.heartbeat_interval_s):
            started_s = self._round_started_s
            if started_s is not None and time.monotonic() - started_s > MANAGER_STALL_S:
                if not self._stall_logged:
                    logger.error("kv manager %s: one round has run for over %.0f s; load reports stop until "
                                 "it ends", self.args.instance_id, MANAGER_STALL_S)
                    self._stall_logged = True
                continue
            self._stall_logged = False
            try:
                self._heartbeat()
            except Exception:
                logger.exception("kv manager %s: heartbeat failed", self.args.instance_id)

    def set_draining(self) -> None:
        """The model is being unloaded: this instance's listing at its own rendezvous says ``draining`` from
        now on, so routers stop pairing it (``InstanceStatus.draining``); its rooms carry on. Any thread,
        idempotent; before ``start`` it takes effect at the registration."""
        self._draining = True
        if self.epoch:
            self._rendezvous.set_draining(self.args.instance_id, self.epoch)

    def _heartbeat(self) -> None:
        if not self._rendezvous.report_load(self.args.instance_id, self.epoch, self._load()):
            self._register()   # it expired (the process stalled past the TTL)

    def _register(self) -> None:
        """This epoch's registration at the instance's own rendezvous, with its draining mark if it has
        one."""
        self._rendezvous.register(self._registration())
        if self._draining:
            self._rendezvous.set_draining(self.args.instance_id, self.epoch)
