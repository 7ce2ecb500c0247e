"""The decode manager thread's work: handshake with prefill peers, publish destinations, collect chunks,
time rooms out, cancel and release.

Every rendezvous call goes to the prefill instance's own rendezvous (``KVReceiver.prefill_rendezvous_url``,
from the router's request): a refused connection there means the prefill process is gone, so the room fails at
once instead of waiting for a timeout. Rendezvous calls happen on the manager thread; so do transport calls,
except the notification draining that ``drain_now`` does for callers of ``KVReceiver.poll``
(``KVArgs.inline_progress``). Receivers are touched under the manager lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from bootstrap.client import ClientPool
from bootstrap.errors import BootstrapError, RendezvousRefused, TLSRefused
from bootstrap.messages import Destination
from kv_transfer.auxbuf import AuxBuffer
from kv_transfer.config import KVArgs
from kv_transfer.errors import CompatibilityError
from kv_transfer.metrics import Metrics
from kv_transfer.peers import PeerTable
from kv_transfer.poll import KVPoll, advance
from kv_transfer.receiver import KVReceiver, Room
from kv_transfer.tags import ABORTED_BY_PREFILL, UNSETTLED, Tag, TagKind
from kv_transfer.transport import LockedTransport, PeerUnreachable, TransportError

logger = logging.getLogger(__name__)
RETRY_S = 0.05
RELEASE_INTERVAL_S = 0.02
#: A release the prefill's rendezvous did not take (partitioned, overloaded) is tried again after
#: ``RELEASE_INTERVAL_S * 2**attempts`` seconds, at most ``RELEASE_BACKOFF_MAX_S`` (a partition of the decode
#: host made a failing release every 20 ms, one log line each, for the partition's length).
RELEASE_BACKOFF_MAX_S = 2.0
#: A cancel the writer has not answered (``done``) is sent again after this long, doubling up to
#: ``CANCEL_RESEND_MAX_S``: a message may be lost (Mooncake drops the messages queued behind a write that
#: failed, as after a partition; a peer's answer can be queued behind it), and the room's pages wait for the
#: answer.
CANCEL_RESEND_S = 1.0
CANCEL_RESEND_MAX_S = 8.0
FULL_ROUND_S = 0.001   # between full rounds, a round nobody woke only drains notifications
INLINE_DRAIN_INTERVAL_S = 50e-6   # receivers polled back to back drain once (one drain serves every room)
INLINE_ACTIVE_TICK_S = 0.005      # thread wait while rooms are open, with inline progress
#: A fence (``Transport.fence_incoming``) still failing after this long is given up and the pages released,
#: seconds: a transport that cannot close its own connections is broken, and pages held for ever are a leak.
FENCE_GIVE_UP_S = 30.0


class DecodeSide:
    def __init__(self, args: KVArgs, transport: LockedTransport, clients: ClientPool, peers: PeerTable,
                 aux: AuxBuffer, lock: threading.RLock, rendezvous_url: str) -> None:
        self._args, self._transport, self._clients, self._peers = args, transport, clients, peers
        self._rendezvous_url = rendezvous_url   # ours: prefill fetches our registration there
        self._aux, self._lock = aux, lock
        self.metrics = Metrics()
        self.receivers: dict[Room, KVReceiver] = {}
        self._retry_at_s: dict[str, float] = {}   # prefill instance id → next handshake attempt
        self._publish_retry_at_s: dict[Room, float] = {}   # room → next attempt to post its destination
        self._next_peer_check_s = 0.0
        self._peer_progress_s: dict[str, float] = {}   # prefill agent → last time any of its chunks
                                                       # landed here
        self._next_release_s = 0.0
        self._next_full_s = 0.0
        self._wait_s = args.idle_tick_s
        self._last_inline_drain_s = 0.0

    def create_receiver(self, room: Room, prefill_instance_id: str, prefill_rendezvous_url: str,
                        wake: threading.Event, now_s: float) -> KVReceiver:
        with self._lock:
            receiver = KVReceiver(room, prefill_instance_id, self._lock, wake, now_s,
                                  prefill_rendezvous_url=prefill_rendezvous_url,
                                  drain=self.drain_now if self._args.inline_progress else None,
                                  page_size=self._args.layout.page_size)
            if room in self.receivers:
                receiver.fail("room already in use on this decode instance")
                self.metrics.failed_rooms_total += 1
            else:
                self.receivers[room] = receiver
        return receiver

    @property
    def open_rooms(self) -> int:
        return len(self.receivers)

    def tick(self, now_s: float, woken: bool = True) -> float:
        """One round of work; returns how long the thread may wait before the next one.

        A round that ``woken`` says came from the wait timing out, within ``FULL_ROUND_S`` of the last full
        round, only drains notifications: the chunk that completes a room is seen as often as before at a
        fifth of the CPU (a full round walks every receiver and costs ~50 us of Python on the dev VM)."""
        self._drain_notifs(now_s)
        if not woken and now_s < self._next_full_s:
            return self._wait_s
        self._next_full_s = now_s + FULL_ROUND_S
        self._handshake(now_s)
        self._publish(now_s)
        with self._lock:
            self._timeouts(now_s)
        if now_s >= self._next_release_s:   # rendezvous HTTP in batches, away from the moment a
                                            # room completes
            self._next_release_s = now_s + RELEASE_INTERVAL_S
            self._cancel_and_release(now_s)
            self._resend_cancels(now_s)
            self._fence(now_s)   # failed rooms only: batched with the releases, off the per-round path
        self._check_peers(now_s)
        with self._lock:
            self._close()
            busy = any(r.published and not r.closed for r in self.receivers.values())
            waiting = any(r.state == KVPoll.Bootstrapping for r in self.receivers.values())
        idle_s = RETRY_S / 5 if waiting else self._args.idle_tick_s
        # with inline progress the callers' polls read the notifications that complete rooms; the thread only
        # keeps timeouts, releases and late tags going, and rounds every 0.2 ms would burn the decode core
        # while a room waits for its KV (the whole prefill)
        active_s = max(self._args.active_tick_s, INLINE_ACTIVE_TICK_S) if self._args.inline_progress \
            else self._args.active_tick_s
        self._wait_s = active_s if busy else idle_s
        return self._wait_s

    def shutdown(self, deadline_s: float, now_fn: Callable[[], float]) -> None:
        """Fails every open room and cancels it at the prefill side, waiting for answers until
        ``deadline_s``."""
        with self._lock:
            for receiver in self.receivers.values():
                receiver.fail("decode manager shut down")
        while now_fn() < deadline_s:
            self._drain_notifs(now_fn())
            # an unreachable prefill rendezvous is not waited for: it drops this instance's rooms when the
            # registration goes (deregistered next, or expired)
            self._cancel_and_release(now_fn(), give_up_unreachable=True)
            self._fence(now_fn())
            with self._lock:
                self._close()
                if not self.receivers:
                    return
            threading.Event().wait(0.001)

    # --- handshake and publication --------------------------------------------------------------------
    def _handshake(self, now_s: float) -> None:
        with self._lock:
            wanted = {r.prefill_instance_id: r.prefill_rendezvous_url for r in self.receivers.values()
                      if r.state == KVPoll.Bootstrapping and r.peer is None}
        for instance_id, url in wanted.items():
            if now_s < self._retry_at_s.get(instance_id, 0.0):
                continue
            old = self._peers.get(instance_id)
            try:
                peer = self._peers.ensure(instance_id, url)
            except CompatibilityError as exc:
                self._fail_bootstrapping(instance_id, f"incompatible prefill instance: {exc}")
                continue
            except (RendezvousRefused, TLSRefused, LookupError, PeerUnreachable) as exc:
                # nothing listens there, another instance does, its certificate is not the fleet's, or the
                # transport cannot reach it: a retry would fail the same way until the rooms time out
                self._fail_bootstrapping(instance_id, f"prefill instance {instance_id} unreachable: {exc}")
                continue
            except (TransportError, BootstrapError) as exc:
                logger.info("handshake with prefill %s not possible yet: %s", instance_id, exc)
                self._retry_at_s[instance_id] = now_s + RETRY_S
                continue
            with self._lock:
                if old is not None and old.agent_name != peer.agent_name:
                    self._on_peer_lost(old.agent_name, "prefill instance restarted")
                for receiver in self.receivers.values():
                    if receiver.prefill_instance_id == instance_id and receiver.peer is None:
                        receiver.peer = peer

    def _publish(self, now_s: float) -> None:
        with self._lock:
            ready = [r for r in self.receivers.values()
                     if r.state == KVPoll.Bootstrapping and r.peer is not None
                     and r.dst_page_ids is not None and not r.published
                     and now_s >= self._publish_retry_at_s.get(r.room, 0.0)]
            for receiver in ready:
                if receiver.aux_slot is None:
                    receiver.aux_slot = self._aux.alloc()
            destinations = [(r, Destination(r.room, r.prefill_instance_id, self._args.instance_id,
                                            self._transport.agent_name, r.xfer_id, list(r.dst_page_ids or []),
                                            r.aux_slot, r.num_cached_tokens, self._rendezvous_url))
                            for r in ready if r.aux_slot is not None]
            for receiver in ready:
                receiver.publishing = receiver.aux_slot is not None
                if receiver.aux_slot is None:
                    self._fail(receiver, "no free aux slot")
        for receiver, destination in destinations:
            try:
                result = self._clients.get(receiver.prefill_rendezvous_url).post_destination(destination)
            except RendezvousRefused as exc:
                with self._lock:
                    receiver.publishing = False
                    self._fail(receiver, f"prefill instance unreachable: {exc}")
                continue
            except BootstrapError as exc:
                logger.warning("room %d: cannot post destination: %s", receiver.room, exc)
                self._publish_retry_at_s[receiver.room] = now_s + RETRY_S
                with self._lock:
                    receiver.publishing = False
                continue
            with self._lock:
                receiver.publishing = False
                if result.accepted:
                    receiver.published, receiver.progress_s = True, now_s
                    self.metrics.skipped_pages_total += (receiver.num_cached_tokens
                                                         // self._args.layout.page_size)
                    receiver.state = advance(receiver.state, KVPoll.WaitingForInput)
                else:   # room in use, or that rendezvous is not (any more) this prefill instance's
                    self._fail(receiver, result.reason)
            if result.accepted and receiver.peer and result.prefill_agent_name != receiver.peer.agent_name:
                self._rehandshake(receiver, result.prefill_agent_name)

    def _rehandshake(self, receiver: KVReceiver, agent_name: str) -> None:
        """The prefill instance restarted since our handshake: the new agent will write this room; rooms
        published to the old agent have lost their writer."""
        old = receiver.peer
        assert old is not None
        try:
            peer = self._peers.ensure(receiver.prefill_instance_id, receiver.prefill_rendezvous_url,
                                      expected_agent=agent_name)
        except (CompatibilityError, LookupError, TransportError, BootstrapError) as exc:
            with self._lock:
                self._fail(receiver, f"prefill instance restarted and the handshake failed: {exc}")
            return
        with self._lock:
            receiver.peer = peer
            self._on_peer_lost(old.agent_name, "prefill instance restarted")

    # --- notifications, timeouts, cancel, release ------------------------------------------------------
    def drain_now(self) -> None:
        """Reads arrived notifications from the calling thread (inline progress), at most once per
        ``INLINE_DRAIN_INTERVAL_S``, and not while the manager thread handshakes (the caller, an engine loop
        serving every request of this instance, never waits behind one peer). Never raises: a transport error
        is left to the manager thread."""
        now_s = time.monotonic()
        if now_s - self._last_inline_drain_s < INLINE_DRAIN_INTERVAL_S:
            return
        self._last_inline_drain_s = now_s
        try:
            # never behind a handshake (seconds across hosts): the manager thread drains after it
            with self._transport.held_unless_handshaking() as held:
                notifs = self._transport.get_notifs() if held else []
            self._on_notifs(notifs, now_s)
        except Exception:  # the caller's thread (an engine loop) must keep running
            logger.exception("draining notifications in the caller's thread failed")

    def _drain_notifs(self, now_s: float) -> None:
        self._on_notifs(self._transport.get_notifs(), now_s)

    def _on_notifs(self, notifs: list[tuple[str, bytes]], now_s: float) -> None:
        for _agent, message in notifs:
            tag = Tag.decode(message)
            if tag is None:
                continue
            with self._lock:
                receiver = self.receivers.get(tag.room)
                if receiver is None or receiver.xfer_id != tag.xfer_id:
                    continue
                self._on_tag(receiver, tag, now_s)

    def _on_tag(self, receiver: KVReceiver, tag: Tag, now_s: float) -> None:
        if receiver.peer is not None:
            self._peers.heard_from(receiver.peer.instance_id)   # a notification from it: alive
        if tag.kind == TagKind.CHUNK and not receiver.state.is_terminal:
            # a chunk seen before is counted once (Mooncake delivers a write's notification more than once:
            # kv_transfer.mooncake_transport.RESEND_AFTER_S)
            self.metrics.chunks_total += int(tag.index not in receiver.chunks_seen)
            if receiver.peer is not None:
                self._peer_progress_s[receiver.peer.agent_name] = now_s
            if receiver.on_chunk(tag.index, tag.total_chunks, now_s):
                assert receiver.aux_slot is not None
                receiver.complete(self._aux.read(receiver.aux_slot))
                if receiver.state == KVPoll.Success:
                    self.metrics.transfers_total += 1
                else:
                    self._fail(receiver, "aux data check failed")
        elif tag.kind == TagKind.ABORT:
            self._fail(receiver, ABORTED_BY_PREFILL + tag.text.removeprefix(ABORTED_BY_PREFILL))
            receiver.writer_done = True
            receiver.fence_needed |= tag.index == UNSETTLED
        elif tag.kind == TagKind.DONE:
            receiver.writer_done = True
            receiver.fence_needed |= tag.index == UNSETTLED
        elif tag.kind == TagKind.QUEUED and receiver.state == KVPoll.WaitingForInput:
            receiver.progress_s = now_s   # still queued at a prefill that is working through its queue

    def _timeouts(self, now_s: float) -> None:
        for receiver in self.receivers.values():
            age_s = now_s - receiver.created_s
            if receiver.state == KVPoll.Bootstrapping and age_s > self._args.bootstrap_timeout_s:
                self._fail(receiver, f"bootstrap timeout: not published within "
                                     f"{self._args.bootstrap_timeout_s}s", timed_out=True)
            elif (receiver.state in (KVPoll.WaitingForInput, KVPoll.Transferring)
                  and now_s - self._progress_s(receiver) > self._args.waiting_timeout_s):
                self._fail(receiver, f"waiting timeout: no KV for {self._args.waiting_timeout_s}s",
                           timed_out=True)
                # its writer's state is unknown (its abort may have been lost in a partition, and its answer
                # to our cancel may come from a manager that forgot the room): fence before the pages go back
                receiver.fence_needed = True

    def _progress_s(self, receiver: KVReceiver) -> float:
        """When ``receiver``'s transfer last moved, for the waiting timeout. A room still waiting for its
        first chunk counts its prefill's chunks for our other rooms too: that prefill is alive and working
        through its queue, and this room is queued behind them. Without it, rooms queued behind one busy
        prefill (its peer restarting) failed after ``waiting_timeout_s`` and were retried at the back of the
        same queue (30 rooms in one 9-minute chaos run). Rooms queued there behind other decode instances'
        rooms hear it from the prefill itself (``queued`` notifications, which move ``progress_s``). A room
        whose chunks started and then stopped is timed on its own."""
        if receiver.state != KVPoll.WaitingForInput or receiver.peer is None:
            return receiver.progress_s
        return max(receiver.progress_s, self._peer_progress_s.get(receiver.peer.agent_name, 0.0))

    def _cancel_and_release(self, now_s: float, give_up_unreachable: bool = False) -> None:
        """Releases finished rooms at their prefill's rendezvous; a failed room's writer is sent a cancel. A
        release that fails is tried again with a backoff (``RELEASE_BACKOFF_MAX_S``), or, with
        ``give_up_unreachable`` (shutdown: no backoff), given up: the room is fenced instead."""
        with self._lock:
            todo = [r for r in self.receivers.values()
                    if r.published and not r.room_released and r.state.is_terminal
                    and (give_up_unreachable or now_s >= r.release_next_s)]
        for receiver in todo:
            try:
                released = self._clients.get(receiver.prefill_rendezvous_url).release_room(
                    receiver.room, self._args.instance_id)
            except RendezvousRefused:
                with self._lock:   # the prefill process is gone: only what its kernel still sends can land
                    receiver.room_released = True
                    receiver.writer_done = receiver.fence_needed = True
                continue
            except BootstrapError as exc:
                receiver.release_attempts += 1
                delay_s = min(RELEASE_BACKOFF_MAX_S, RELEASE_INTERVAL_S * 2 ** receiver.release_attempts)
                receiver.release_next_s = now_s + delay_s
                logger.warning("room %d: cannot release at prefill's rendezvous (attempt %d, next in "
                               "%.2f s): %s", receiver.room, receiver.release_attempts, delay_s, exc)
                if give_up_unreachable:
                    with self._lock:
                        receiver.room_released = True
                        receiver.writer_done = receiver.fence_needed = True
                continue
            with self._lock:
                receiver.room_released = True
                if receiver.state == KVPoll.Failed and released.known and not released.delivered:
                    receiver.writer_done = True   # the prefill side never learned where to write
                if receiver.state == KVPoll.Failed and not receiver.writer_done and receiver.peer is not None:
                    self._send_cancel(receiver, now_s)

    def _resend_cancels(self, now_s: float) -> None:
        """A failed room whose writer has not answered its cancel (``done``, or an ``abort``) gets it again,
        every ``CANCEL_RESEND_S`` doubling to ``CANCEL_RESEND_MAX_S`` (either message may have been lost: the
        prefill side answers a cancel of a room it forgot too). No answer within ``KVArgs.waiting_timeout_s``
        of the first cancel: the writer's connections are fenced (``_fence``) and the pages go back, as for a
        room whose KV stopped coming."""
        with self._lock:
            for receiver in self.receivers.values():
                if (receiver.state != KVPoll.Failed or not receiver.room_released or receiver.writer_done
                        or receiver.peer is None or now_s < receiver.cancel_next_s):
                    continue
                first_s = receiver.cancel_first_s
                if first_s is not None and now_s - first_s > self._args.waiting_timeout_s:
                    logger.warning("room %d: %s did not answer its cancel in %.0f s; fencing its connections "
                                   "before the pages go back", receiver.room, receiver.peer.instance_id,
                                   now_s - first_s)
                    receiver.writer_done = receiver.fence_needed = True
                    continue
                if first_s is not None:
                    logger.info("room %d: no answer to its cancel from %s in %.1f s; sending it again",
                                receiver.room, receiver.peer.instance_id, now_s - first_s)
                self._send_cancel(receiver, now_s)

    def _fence(self, now_s: float) -> None:
        """Fences the writers of failed rooms whose last write may still be on the way (``fence_needed``),
        once their writer is done, per peer, outside the manager lock (the transport may wait for sockets to
        close). A fence that keeps failing for ``FENCE_GIVE_UP_S`` is given up, logged as an error: the pages
        are then released rather than held for ever."""
        todo: dict[str, list[KVReceiver]] = {}
        with self._lock:
            for receiver in self.receivers.values():
                if not receiver.fence_needed or receiver.fenced or not receiver.writer_done:
                    continue
                if receiver.peer is None:
                    receiver.fenced = True   # no handshake, so no connection of its writer
                    continue
                if receiver.fence_since_s is None:
                    receiver.fence_since_s = now_s
                todo.setdefault(receiver.peer.agent_name, []).append(receiver)
        for agent_name, receivers in todo.items():
            fenced = self._transport.fence_incoming(agent_name)
            with self._lock:
                for receiver in receivers:
                    assert receiver.fence_since_s is not None
                    if not fenced and now_s - receiver.fence_since_s < FENCE_GIVE_UP_S:
                        continue
                    if not fenced:
                        logger.error("room %d: could not fence %s's connections in %.0f s; releasing its "
                                     "pages anyway", receiver.room, agent_name, FENCE_GIVE_UP_S)
                    receiver.fenced = True
                    self.metrics.fenced_rooms_total += 1

    def _send_cancel(self, receiver: KVReceiver, now_s: float) -> None:
        """Tells the room's writer to stop (caller holds the lock); the next one goes out after a backoff
        unless the writer answers first (``_resend_cancels``)."""
        reason = receiver.failure.reason if receiver.failure else ""
        peer = receiver.peer
        assert peer is not None   # the caller checked
        if receiver.cancel_first_s is None:
            receiver.cancel_first_s = now_s
        waited_s = now_s - receiver.cancel_first_s
        receiver.cancel_next_s = now_s + min(CANCEL_RESEND_MAX_S, max(CANCEL_RESEND_S, waited_s))
        try:
            tag = Tag(TagKind.CANCEL, receiver.room, receiver.xfer_id, 0, reason)
            self._transport.send_notif(peer.agent_name, tag.encode())
        except TransportError as exc:
            logger.warning("room %d: cannot send cancel: %s", receiver.room, exc)

    def _check_peers(self, now_s: float) -> None:
        if now_s < self._next_peer_check_s:
            return
        self._next_peer_check_s = now_s + self._args.peer_check_interval_s
        with self._lock:
            in_use = {r.peer.instance_id: r.peer for r in self.receivers.values()
                      if r.peer is not None and not r.writer_done and not r.closed}
        for instance_id, peer in in_use.items():
            try:
                alive = self._peers.check_alive(instance_id, now_s)
            except BootstrapError as exc:
                logger.warning("cannot check prefill %s: %s", instance_id, exc)
                continue
            if alive:
                continue
            with self._lock:
                self._on_peer_lost(peer.agent_name, "prefill instance lost (its rendezvous refused us, "
                                                    "forgot it or stayed silent, or it restarted)")

    def _on_peer_lost(self, agent_name: str, reason: str) -> None:
        """Rooms published to a dead agent fail (their writer is gone); unpublished ones handshake again."""
        self._peer_progress_s.pop(agent_name, None)
        for receiver in self.receivers.values():
            if receiver.peer is None or receiver.peer.agent_name != agent_name:
                continue
            if receiver.published or receiver.publishing:
                self._fail(receiver, reason)
                receiver.writer_done = receiver.fence_needed = True
            else:
                receiver.peer = None

    def _close(self) -> None:
        for room, receiver in list(self.receivers.items()):
            if not receiver.state.is_terminal or (receiver.published and not receiver.room_released):
                continue
            if receiver.state == KVPoll.Failed and receiver.published and not receiver.writer_done:
                continue
            if receiver.fence_needed and not receiver.fenced:
                continue
            if receiver.publishing:
                continue
            if receiver.aux_slot is not None:
                self._aux.free(receiver.aux_slot)
            self._publish_retry_at_s.pop(room, None)
            self.metrics.failed_rooms_total += int(receiver.state == KVPoll.Failed)
            receiver.closed = True
            del self.receivers[room]

    def _fail_bootstrapping(self, instance_id: str, reason: str) -> None:
        with self._lock:
            for receiver in self.receivers.values():
                if receiver.prefill_instance_id == instance_id and receiver.state == KVPoll.Bootstrapping:
                    self._fail(receiver, reason)

    def _fail(self, receiver: KVReceiver, reason: str, timed_out: bool = False) -> None:
        if receiver.state.is_terminal:
            return
        receiver.fail(reason)
        self.metrics.timed_out_rooms_total += int(timed_out)
        logger.warning("room %d: failed: %s", receiver.room, reason)
