"""The prefill manager thread's work: take destinations, post chunk WRITEs, track them, answer cancels.

Destinations arrive at this instance's own rendezvous (``bootstrap.rendezvous``, a thread of this process),
which wakes the manager thread; the thread takes them in-process. Rendezvous calls to decode instances (their
registration for the handshake, liveness checks) happen on the manager thread; so do transport calls, except
the last chunk's WRITE, which ``post_now`` posts from the caller of ``send`` (``KVArgs.inline_progress``).
Senders are touched under the manager lock.
Rooms aborted before their destination arrived are remembered (``_tombstones``) so that the decode side is
told as soon as its destination shows up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from bootstrap.errors import BootstrapError
from bootstrap.messages import Destination
from bootstrap.rendezvous import Rendezvous
from kv_transfer.auxbuf import AuxBuffer
from kv_transfer.blocks import BlockTable
from kv_transfer.config import KVArgs
from kv_transfer.errors import CompatibilityError
from kv_transfer.head_slices import head_sliced_spans
from kv_transfer.metrics import Metrics
from kv_transfer.peers import Peer, PeerTable
from kv_transfer.poll import KVPoll, advance
from kv_transfer.sender import Chunk, KVSender, Room
from kv_transfer.tags import ABORTED_BY_DECODE, UNSETTLED, Tag, TagKind, chunk_tag
from kv_transfer.transport import LockedTransport, TransportError, XferState

logger = logging.getLogger(__name__)
# (sender, chunk, peer, local, remote, tag, KV bytes): local/remote are descriptor indices (int64 [n]) or, for
# a last chunk whose last page is partly filled and between instances whose KV heads are split differently,
# explicit spans (int64 [n, 2] address, nbytes)
_Post = tuple[KVSender, Chunk, Peer, np.ndarray, np.ndarray, 'Tag | None', int]


class _Written(NamedTuple):
    """What posting one chunk gave: its handle (None: nothing to track, a notification only) or the error."""

    handle: object | None
    error: Exception | None
    start_s: float
    posted_s: float


class PrefillSide:
    def __init__(self, args: KVArgs, transport: LockedTransport, rendezvous: Rendezvous, peers: PeerTable,
                 aux: AuxBuffer, lock: threading.RLock) -> None:
        self._args, self._transport, self._rendezvous, self._peers = args, transport, rendezvous, peers
        self._table = BlockTable(args.kv_base_ptr, args.layout, aux.base_ptr, aux.num_slots, args.kv_regions)
        self._aux, self._lock = aux, lock
        self.metrics = Metrics()
        self.senders: dict[Room, KVSender] = {}
        self._pending: dict[Room, tuple[Destination, Peer, float]] = {}
        self._deferred: list[_Post] = []   # taken by ``post_now`` as a handshake began: posted by the thread
        self._tombstones: dict[Room, float] = {}
        self._next_poll_s = 0.0
        self._next_peer_check_s = 0.0
        self._next_keepalive_s = 0.0
        self._last_post_s = float("-inf")   # when a chunk was last posted (any room): this prefill is working

    def create_sender(self, room: Room, wake: threading.Event, now_s: float) -> KVSender:
        with self._lock:
            sender = KVSender(room, self._lock, wake, now_s,
                              post_now=self.post_now if self._args.inline_progress else None,
                              page_size=self._args.layout.page_size)
            if room in self.senders:
                sender.fail("room already in use on this prefill instance")
                return sender
            self._tombstones.pop(room, None)
            self.senders[room] = sender
        return sender

    def tick(self, now_s: float, woken: bool = True) -> float:
        """One round of work; returns how long the thread may wait before the next one (every round is a
        full one here: ``woken`` is for the decode side)."""
        with self._lock:  # queued chunks first: bootstrap HTTP calls below must not delay a WRITE
            posts = self._collect(now_s)
        self._post_all(posts)
        self._drain_notifs()
        with self._lock:
            self._progress()
        self._poll_destinations(now_s, woken)
        self._check_peers(now_s)
        self._keep_queued_alive(now_s)
        with self._lock:
            return self._next_wait_s()

    def shutdown(self, deadline_s: float, now_fn: Callable[[], float]) -> None:
        """Fails every open room, tells the decode sides, waits for WRITEs in flight until ``deadline_s``."""
        with self._lock:
            for sender in self.senders.values():
                sender.fail("prefill manager shut down", notify_peer=True)
        while now_fn() < deadline_s:
            with self._lock:
                self._progress()
                if not self.senders:
                    return
            threading.Event().wait(0.001)

    # --- destinations -------------------------------------------------------------------------------------
    def _poll_destinations(self, now_s: float, woken: bool) -> None:
        """Takes new destinations from our rendezvous (in-process): at once when woken (a destination's
        arrival wakes the thread), else on the poll interval."""
        if now_s < self._next_poll_s and not woken:
            return
        with self._lock:
            waiting = any(s.state == KVPoll.Bootstrapping for s in self.senders.values())
        interval_s = self._args.bootstrap_poll_interval_s if waiting else self._args.idle_poll_interval_s
        self._next_poll_s = now_s + interval_s
        destinations = self._rendezvous.take_destinations(self._args.instance_id)
        for destination in destinations:
            self._peers.heard_from(destination.decode_instance_id)   # it reached us: alive
            self._accept(destination, now_s)

    def _accept(self, dest: Destination, now_s: float) -> None:
        room = dest.room
        try:
            old = self._peers.get(dest.decode_instance_id)
            peer = self._peers.ensure(dest.decode_instance_id, dest.decode_rendezvous_url,
                                      dest.decode_agent_name)
        except (CompatibilityError, LookupError, TransportError, BootstrapError) as exc:
            logger.error("room %d: handshake with decode %s failed: %s", room, dest.decode_instance_id, exc)
            with self._lock:
                if room in self.senders:
                    self._fail(self.senders[room], f"handshake with decode failed: {exc}")
            return
        with self._lock:
            if old is not None and old.agent_name != peer.agent_name:
                self._fail_peer(old, "decode instance restarted")
            sender = self.senders.get(room)
            if room in self._tombstones:
                del self._tombstones[room]
                self._notify(peer, Tag(TagKind.ABORT, room, dest.xfer_id, 0, "prefill aborted the room"))
            elif sender is not None and sender.destination is None and not sender.state.is_terminal:
                sender.attach(dest, peer)
            elif sender is not None:
                self._notify(peer, Tag(TagKind.ABORT, room, dest.xfer_id, 0,
                                       "room already has a destination"))
            else:
                self._pending[room] = (dest, peer, now_s)

    def _keep_queued_alive(self, now_s: float) -> None:
        """Every ``queued_keepalive_s``, while this prefill keeps posting chunks (for any room, any decode): a
        ``queued`` notification to the decode of each room whose destination is in and whose first chunk is
        not yet computed. Its decode counts it as progress against its waiting timeout: without it a room
        queued here behind rooms of *other* decode instances saw nothing for the whole timeout and failed (4
        rooms in a 2P2D chaos run of 9 minutes), though this prefill was alive and would have reached it. A
        prefill that posts nothing (its engine stuck) says nothing, and its rooms time out as before."""
        if now_s < self._next_keepalive_s:
            return
        interval_s = self._args.queued_keepalive_s
        self._next_keepalive_s = now_s + interval_s
        if now_s - self._last_post_s > 2 * interval_s:
            return
        with self._lock:
            queued = [(s.peer, Tag(TagKind.QUEUED, room, s.destination.xfer_id))
                      for room, s in self.senders.items()
                      if s.state == KVPoll.WaitingForInput and s.peer is not None
                      and s.destination is not None]
        for peer, tag in queued:
            self._notify(peer, tag)

    # --- posting ------------------------------------------------------------------------------------------
    def _collect(self, now_s: float) -> list[_Post]:
        posts, self._deferred = self._deferred, []
        for room, sender in self.senders.items():
            if sender.destination is None and room in self._pending and not sender.state.is_terminal:
                dest, peer, _ = self._pending.pop(room)
                sender.attach(dest, peer)
            age_s = now_s - sender.created_s
            if sender.state == KVPoll.Bootstrapping and age_s > self._args.bootstrap_timeout_s:
                self._fail(sender, f"bootstrap timeout: no destination from decode within "
                                   f"{self._args.bootstrap_timeout_s}s", timed_out=True)
            posts.extend(self._take_queued(sender))
        for room, (dest, peer, since_s) in list(self._pending.items()):
            if now_s - since_s > self._args.bootstrap_timeout_s:
                del self._pending[room]
                self._notify(peer, Tag(TagKind.ABORT, room, dest.xfer_id, 0,
                                       "no prefill request for this room"))
        for room in [r for r, until_s in self._tombstones.items() if until_s < now_s]:
            del self._tombstones[room]
        return posts

    def post_now(self, sender: KVSender) -> None:
        """Posts the queued chunks of ``sender`` from the calling thread (inline progress; the manager thread
        still tracks them to completion). A chunk is taken off the queue under the lock, so each is posted
        once, by whichever thread takes it. While the manager thread handshakes with a peer (seconds across
        hosts, the agent held) the chunks are left to it instead: the caller, an engine loop serving every
        request of this instance, never waits behind one peer's handshake. Never raises: a failure fails this
        room."""
        if self._transport.handshaking:
            return   # still queued: the manager thread posts them (``send`` wakes it)
        with self._lock:
            posts = [] if sender.closed else self._take_queued(sender)
        if not posts:
            return
        with self._transport.held_unless_handshaking() as held:
            outcomes = [self._write(post) for post in posts] if held else []
        if not held:   # a handshake began since the check above: the manager thread posts them
            with self._lock:
                self._deferred.extend(posts)
            return
        for post, outcome in zip(posts, outcomes):
            self._settle(post, outcome)

    def _take_queued(self, sender: KVSender) -> list[_Post]:
        """Lock held: the queued chunks of ``sender`` as posts, once its destination is known. Never raises:
        an unexpected error fails this room only."""
        posts: list[_Post] = []
        while sender.destination is not None and sender.queued and sender.state != KVPoll.Failed:
            chunk = sender.queued.popleft()
            try:
                post = self._prepare(sender, chunk)
            except Exception as exc:  # a bug; the caller may be an engine loop, which must keep running
                logger.exception("room %d: preparing chunk %d failed", sender.room, chunk.index)
                self._fail(sender, f"preparing chunk {chunk.index} failed: {exc!r}")
                break
            if post is not None:
                sender.posting += 1
                posts.append(post)
        return posts

    def _post_all(self, posts: list[_Post]) -> None:
        """Posts each prepared chunk. Never raises: an unexpected error fails that room only."""
        for post in posts:
            self._settle(post, self._write(post))

    def _prepare(self, sender: KVSender, chunk: Chunk) -> _Post | None:
        dest, peer = sender.destination, sender.peer
        assert dest is not None and peer is not None
        # decode holds the prompt's first ``skip`` pages (its prefix cache): drop them from the chunk, and
        # prompt page i lands in dst_page_ids[i - skip]; a chunk left empty still sends its notification
        skip = sender.num_skipped_pages
        drop = min(len(chunk.src_pages), max(0, skip - chunk.dst_start))
        if skip:
            self.metrics.skipped_pages_total += drop
            chunk = replace(chunk, src_pages=chunk.src_pages[drop:], dst_start=chunk.dst_start + drop - skip)
        dst_pages = dest.dst_page_ids[chunk.dst_start:chunk.dst_start + len(chunk.src_pages)]
        if self._table.sliced or peer.table.sliced:
            return self._prepare_sliced(sender, chunk, peer, dst_pages)
        page_bytes = self._table.kv_desc_bytes
        if not (chunk.is_last and chunk.aux is not None):
            local, remote = self._table.kv_indices(chunk.src_pages), peer.table.kv_indices(dst_pages)
            return (sender, chunk, peer, local, remote, chunk_tag(sender.room, dest.xfer_id, chunk.index, 0),
                    len(chunk.src_pages) * page_bytes)
        slot = self._aux.alloc()
        if slot is None:  # aux_slots bounds the last chunks in flight
            self._fail(sender, "no free aux staging slot (raise KVArgs.aux_slots)")
            return None
        self._aux.write(slot, chunk.aux)
        sender.local_aux_slot = slot
        tag = chunk_tag(sender.room, dest.xfer_id, chunk.index, chunk.index + 1)
        dram = self._args.mem_type == "DRAM"
        partial = sender.last_page_tokens
        if partial is not None and chunk.src_pages:
            # the prompt's last page holds ``partial`` tokens: only those slots are written (the rest of the
            # page holds no KV yet), as explicit spans in one WRITE with the whole pages before it
            local = self._table.pages_spans(chunk.src_pages, partial)
            remote = peer.table.pages_spans(dst_pages, partial)
            kv_bytes = int(local[:, 1].sum())
            if dram:   # one WRITE: the KV spans and the aux slot
                local = np.concatenate([local, self._table.spans(np.array([self._table.aux_index(slot)]))])
                remote = np.concatenate(
                    [remote, peer.table.spans(np.array([peer.table.aux_index(dest.aux_slot)]))])
        else:
            local = self._table.kv_indices(chunk.src_pages, aux_slot=slot if dram else None)
            remote = peer.table.kv_indices(dst_pages, aux_slot=dest.aux_slot if dram else None)
            kv_bytes = len(chunk.src_pages) * page_bytes
        if dram:
            return sender, chunk, peer, local, remote, tag, kv_bytes
        # KV and aux live in different memory types: the aux WRITE (carrying the last tag) goes out once
        # the KV WRITE is done, so the tag still means "everything has landed"
        sender.aux_post = (np.array([self._table.aux_index(slot)], dtype=np.int64),
                           np.array([peer.table.aux_index(dest.aux_slot)], dtype=np.int64), tag)
        return sender, chunk, peer, local, remote, None, kv_bytes

    def _prepare_sliced(self, sender: KVSender, chunk: Chunk, peer: Peer,
                        dst_pages: list[int]) -> _Post | None:
        """A chunk between instances whose KV is split over ranks differently (issue #45): one WRITE of
        head-sliced spans (``kv_transfer.head_slices``: one per page and head range, the pools being
        head-major inside a page), the aux slot on the last chunk, once. This agent registered every rank's
        pool, so one notification follows every rank pair's bytes. Lock held."""
        dest = sender.destination
        assert dest is not None
        last = chunk.is_last and chunk.aux is not None
        partial = sender.last_page_tokens if last else None
        tag = chunk_tag(sender.room, dest.xfer_id, chunk.index, chunk.index + 1 if last else 0)
        local, remote = head_sliced_spans(self._args.layout, self._table.kv_regions, peer.table.kv_regions,
                                          chunk.src_pages, dst_pages, partial)
        kv_bytes = int(local[:, 1].sum())
        if last:
            slot = self._aux.alloc()
            if slot is None:
                self._fail(sender, "no free aux staging slot (raise KVArgs.aux_slots)")
                return None
            assert chunk.aux is not None
            self._aux.write(slot, chunk.aux)
            sender.local_aux_slot = slot
            local = np.concatenate([local, self._table.spans(np.array([self._table.aux_index(slot)]))])
            aux_remote = peer.table.spans(np.array([peer.table.aux_index(dest.aux_slot)]))
            remote = np.concatenate([remote, aux_remote])
        return sender, chunk, peer, local, remote, tag, kv_bytes

    def _post(self, sender: KVSender, chunk: Chunk, peer: Peer, local: np.ndarray, remote: np.ndarray,
              tag: Tag | None, kv_bytes: int = 0) -> None:
        """Posts one prepared chunk and records the outcome (``_write`` then ``_settle``). Never raises."""
        post = (sender, chunk, peer, local, remote, tag, kv_bytes)
        self._settle(post, self._write(post))

    def _write(self, post: _Post) -> _Written:
        """The transport calls of one prepared chunk, nothing else (no manager lock: ``post_now`` calls it
        holding the transport's lock). Never raises: the error is returned for ``_settle``."""
        _, _, peer, local, remote, tag, _ = post
        notif = tag.encode() if tag is not None else b""
        post_start_s = time.monotonic()
        handle = None
        try:
            if len(local) and local.ndim == 2:
                handle = self._transport.post_write_spans(peer.agent_name, local, remote, notif)
            elif len(local):
                handle = self._transport.post_write(peer.agent_name, local, remote, notif)
            if handle is None and tag is not None:
                self._transport.send_notif(peer.agent_name, notif)
        except Exception as exc:   # TransportError; anything else is a bug, which fails this room only
            return _Written(None, exc, post_start_s, time.monotonic())
        return _Written(handle, None, post_start_s, time.monotonic())

    def _settle(self, post: _Post, written: _Written) -> None:
        """Records a chunk's write under the manager lock (``sender.posting`` counted it when it left the
        queue; this uncounts it under the same lock that records the handle, so no thread ever sees the chunk
        neither queued, posting nor in flight): in flight, or the room failed."""
        sender, chunk, _, _, _, tag, kv_bytes = post
        with self._lock:
            sender.posting -= 1
            if written.error is not None:
                if not isinstance(written.error, TransportError):
                    logger.error("room %d: posting chunk %d failed", sender.room, chunk.index,
                                 exc_info=written.error)
                    self._fail(sender, f"posting chunk {chunk.index} failed: {written.error!r}")
                else:
                    self._fail(sender, f"write of chunk {chunk.index} failed: {written.error}")
                return
            self._last_post_s = written.posted_s
            sender.times.post_start_s, sender.times.posted_s = written.start_s, written.posted_s
            if written.handle is not None:
                sender.inflight.append(written.handle)
            sender.state = advance(sender.state, KVPoll.Transferring)
            sender.last_posted = sender.last_posted or (chunk.is_last and tag is not None)
            self.metrics.kv_bytes_total += kv_bytes   # KV only; the aux slot is not counted
            self.metrics.chunks_total += 1

    # --- progress, notifications, peers ------------------------------------------------------------------
    def _progress(self) -> None:
        for room, sender in list(self.senders.items()):
            self._check_inflight(sender)
            kv_done = not (sender.inflight or sender.posting)
            if sender.aux_post is not None and kv_done and sender.state != KVPoll.Failed:
                aux_local, aux_remote, tag = sender.aux_post
                sender.aux_post = None
                assert sender.peer is not None
                aux_chunk = Chunk(tag.index, [], 0, True, None)
                sender.posting += 1
                self._post(sender, aux_chunk, sender.peer, aux_local, aux_remote, tag)
            if sender.inflight or sender.posting:   # a chunk between the queue and its handle: not done
                continue
            if sender.local_aux_slot is not None:
                self._aux.free(sender.local_aux_slot)
                sender.local_aux_slot = None
            if sender.last_posted and not sender.state.is_terminal:
                sender.state = advance(sender.state, KVPoll.Success)
                sender.times.done_s = time.monotonic()
                self.metrics.transfers_total += 1
                logger.debug("room %d: sent", room)
            if sender.state.is_terminal:
                if sender.pending_notif is not None and sender.peer is not None:
                    # the decode side fences before it reuses the pages when a WRITE failed (tags.UNSETTLED)
                    self._notify(sender.peer, replace(sender.pending_notif, index=UNSETTLED)
                                 if sender.write_failed else sender.pending_notif)
                    sender.pending_notif = None
                if sender.destination is None and sender.state == KVPoll.Failed:
                    self._tombstones[room] = sender.created_s + 2 * self._args.bootstrap_timeout_s + 60.0
                self.metrics.failed_rooms_total += int(sender.state == KVPoll.Failed)
                sender.closed = True
                del self.senders[room]

    def _check_inflight(self, sender: KVSender) -> None:
        still = []
        for handle in sender.inflight:
            state = self._transport.check(handle)
            if state == XferState.PROC:
                still.append(handle)
                continue
            self._transport.release(handle)
            if state == XferState.ERR:
                sender.write_failed = True
                self._fail(sender, "a WRITE to decode failed (decode lost?)")
            elif sender.peer is not None:
                self._peers.heard_from(sender.peer.instance_id)   # a WRITE landed: decode is alive
        sender.inflight = still

    def _drain_notifs(self) -> None:
        unanswered: list[tuple[str, Tag]] = []
        for agent, message in self._transport.get_notifs():
            tag = Tag.decode(message)
            if tag is None or tag.kind != TagKind.CANCEL:
                continue
            with self._lock:
                sender = self.senders.get(tag.room)
                done = Tag(TagKind.DONE, tag.room, tag.xfer_id)
                dest = sender.destination if sender is not None else None
                if sender is not None and dest is not None and dest.xfer_id == tag.xfer_id:
                    self._fail(sender, f"cancelled by decode: {tag.text.removeprefix(ABORTED_BY_DECODE)}")
                    sender.pending_notif = done
                    continue
                pending = self._pending.get(tag.room)
                if pending is not None and pending[0].xfer_id == tag.xfer_id:
                    del self._pending[tag.room]
                try:
                    self._transport.send_notif(agent, done.encode())
                except TransportError:
                    unanswered.append((agent, done))
        for agent, done in unanswered:
            self._answer_forgotten(agent, done)

    def _answer_forgotten(self, agent: str, done: Tag) -> None:
        """A cancel from a peer we forgot (its registration expired while it stalled, then it came back with
        the same agent): handshake again and answer, or the decode side could never free the room's pages."""
        try:
            peer = self._peers.recover(agent)
            if peer is None:
                raise TransportError(f"agent {agent} is unknown here")
            self._transport.send_notif(peer.agent_name, done.encode())
        except (CompatibilityError, LookupError, TransportError, BootstrapError) as exc:
            logger.warning("room %d: cannot answer cancel: %s", done.room, exc)

    def _check_peers(self, now_s: float) -> None:
        if now_s < self._next_peer_check_s:
            return
        self._next_peer_check_s = now_s + self._args.peer_check_interval_s
        with self._lock:
            in_use = {s.peer.instance_id: s.peer for s in self.senders.values()
                      if s.peer is not None and not s.state.is_terminal}
        for instance_id, peer in in_use.items():
            try:
                alive = self._peers.check_alive(instance_id, now_s)
            except BootstrapError as exc:
                logger.warning("cannot check decode %s: %s", instance_id, exc)
                continue
            if not alive:
                with self._lock:
                    self._fail_peer(peer, "decode instance lost (its rendezvous refused us, forgot it or "
                                          "stayed silent, or it restarted)")

    def _fail_peer(self, peer: Peer, reason: str) -> None:
        for sender in self.senders.values():
            if sender.peer is not None and sender.peer.agent_name == peer.agent_name:
                self._fail(sender, reason)

    def _fail(self, sender: KVSender, reason: str, timed_out: bool = False) -> None:
        if sender.state.is_terminal:
            return
        sender.fail(reason, notify_peer=True)
        self.metrics.timed_out_rooms_total += int(timed_out)
        logger.warning("room %d: failed: %s", sender.room, reason)

    def _notify(self, peer: Peer, tag: Tag) -> None:
        try:
            self._transport.send_notif(peer.agent_name, tag.encode())
        except TransportError as exc:
            logger.warning("room %d: cannot notify %s: %s", tag.room, peer.instance_id, exc)

    @property
    def open_rooms(self) -> int:
        return len(self.senders)

    def _next_wait_s(self) -> float:
        """Short rounds only while a WRITE is under way or could be posted: chunks queued before decode's
        destination arrived wait for it (its arrival wakes the thread), so prefill's compute is not robbed of
        a core by a spinning thread meanwhile."""
        if any(s.inflight or (s.queued and s.destination is not None) or s.posting or s.state.is_terminal
               for s in self.senders.values()):
            return self._args.active_tick_s
        if any(s.state == KVPoll.Bootstrapping for s in self.senders.values()):
            return self._args.bootstrap_poll_interval_s
        return self._args.idle_tick_s
