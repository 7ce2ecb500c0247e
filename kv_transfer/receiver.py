"""Decode side, one ``KVReceiver`` per request (room).

Lifecycle of a room on the decode side:
1. ``manager.create_receiver(room, prefill_instance_id, prefill_rendezvous_url)`` → Bootstrapping; the thread
   handshakes with the prefill instance once per peer (compatibility checked before any byte moves)
2. ``init(dst_page_ids)``: the pages the decode engine reserved; an aux slot is taken; the thread posts the
   destination to the bootstrap (a room already in use fails this receiver only)   → WaitingForInput
3. the prefill instance WRITEs chunks; each arrives with a ``chunk`` notification  → Transferring
4. every chunk (the last one names the count) and valid aux data for this room  → Success
Failure (handshake, room in use, bootstrap/waiting timeout, prefill aborted or lost, ``abort``) → Failed.
Pages: free the destination pages only once ``pages_releasable()``: Success, or Failed and the writer is known
done (it answered our cancel, or never learned the destination) or dead, and, when a write of the room failed
or the writer vanished, the transport fenced its connections (no late byte can land: ``fence_incoming``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence

from kv_transfer.aux import AuxData
from kv_transfer.base import BaseKVReceiver
from kv_transfer.errors import TransferError
from kv_transfer.layout import PageId
from kv_transfer.peers import Peer
from kv_transfer.poll import KVPoll, advance
from kv_transfer.tags import ABORTED_BY_DECODE
from kv_transfer.timings import ReceiverTimings

Room = int


class KVReceiver(BaseKVReceiver):
    """Handle of one room on the decode side. Every public method is cheap and thread-safe (one manager lock).

    The attributes below the public methods are owned by the manager thread (read/written under the lock).
    """

    def __init__(self, room: Room, prefill_instance_id: str, lock: threading.RLock, wake: threading.Event,
                 created_s: float, drain: Callable[[], None] | None = None, page_size: int = 1,
                 prefill_rendezvous_url: str = "") -> None:
        self.room = room
        self._page_size = page_size
        self.prefill_instance_id = prefill_instance_id
        self.prefill_rendezvous_url = prefill_rendezvous_url   # the prefill instance's own rendezvous
        self._lock = lock
        self._wake = wake
        self._drain = drain             # inline progress: reads arrived notifications in the caller's thread
        self.created_s = created_s
        self.state = KVPoll.Bootstrapping
        self._failure: TransferError | None = None
        self._aux: AuxData | None = None
        self.dst_page_ids: list[PageId] | None = None
        self.num_cached_tokens = 0      # leading prompt tokens decode already holds; prefill skips
                                        # their pages
        self.aux_slot: int | None = None
        self.xfer_id = uuid.uuid4().hex[:12]
        self.peer: Peer | None = None
        self.publishing = False         # a POST of our destination is under way
        self.published = False          # prefill's rendezvous holds our destination
        self.room_released = False      # ...and no longer does
        self.writer_done = False        # the prefill side will never write for this room again
        self.fence_needed = False       # ...but a write of it failed or its writer vanished: bytes may
                                        # still come
        self.fenced = False             # the transport made sure they cannot land any
                                        # more (``fence_incoming``)
        self.fence_since_s: float | None = None   # the first fence attempt (monotonic seconds)
        self.cancel_first_s: float | None = None   # the first cancel sent to the writer (monotonic seconds)
        self.cancel_next_s = 0.0        # when an unanswered cancel goes out again
        self.release_attempts = 0       # failed releases at the prefill's rendezvous (backoff)
        self.release_next_s = 0.0       # when the release is tried again
        self.progress_s = created_s     # last time a chunk arrived (or the destination went out)
        self.chunks_seen: set[int] = set()
        self.total_chunks = 0
        self.closed = False
        self.times = ReceiverTimings()  # written under the lock; ``timings`` copies it

    # --- caller API (serving layer) ---------------------------------------------------------------------
    def poll(self) -> KVPoll:
        """The room's state. With ``KVArgs.inline_progress``, a room waiting for KV first reads the
        notifications that arrived (for every room; at most once per ~50 us across receivers), so Success
        shows without waiting for the manager thread's next round."""
        if self._drain is not None:
            with self._lock:
                awaiting = self.state in (KVPoll.WaitingForInput, KVPoll.Transferring)
            if awaiting:
                self._drain()
        with self._lock:
            return self.state

    @property
    def failure(self) -> TransferError | None:
        with self._lock:
            return self._failure

    @property
    def aux(self) -> AuxData | None:
        """First token id, its logprob and the room; set at Success."""
        with self._lock:
            return self._aux

    @property
    def timings(self) -> ReceiverTimings:
        """A copy of this room's timestamps (see ``kv_transfer.timings``)."""
        with self._lock:
            return ReceiverTimings(**vars(self.times))

    def init(self, dst_page_ids: Sequence[PageId], num_cached_tokens: int = 0) -> None:
        """Gives the pages reserved for the prompt's KV from token ``num_cached_tokens`` on (owned by the
        caller until ``pages_releasable``); the pages of the first ``num_cached_tokens`` tokens are the
        caller's (prefix cache) and are never written."""
        with self._lock:
            if self.dst_page_ids is not None:
                raise TransferError(self.room, "init called twice")
            reason = None
            if not dst_page_ids:
                reason = "init with no pages"
            elif num_cached_tokens < 0 or num_cached_tokens % self._page_size:
                reason = (f"num_cached_tokens={num_cached_tokens} is not a non-negative multiple of the page "
                          f"size {self._page_size}")
            if reason is not None:
                self.fail(reason)
                raise TransferError(self.room, reason)
            self.dst_page_ids = list(dst_page_ids)
            self.num_cached_tokens = num_cached_tokens
        self._wake.set()

    def abort(self, reason: str) -> None:
        """Gives the room up; the prefill side is told to stop. Idempotent."""
        with self._lock:
            self.fail(ABORTED_BY_DECODE + reason)
        self._wake.set()

    def pages_releasable(self) -> bool:
        """True when no WRITE can land in the destination pages any more."""
        with self._lock:
            if self.state == KVPoll.Success:
                return True
            never_published = not (self.published or self.publishing)
            writer_quiet = self.writer_done and (self.fenced or not self.fence_needed)
            return self.state == KVPoll.Failed and (writer_quiet or never_published)

    # --- manager thread ---------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        if self.state.is_terminal:
            return
        self.state = advance(self.state, KVPoll.Failed)
        self._failure = TransferError(self.room, reason)

    def on_chunk(self, index: int, total_chunks: int, now_s: float) -> bool:
        """A chunk landed; True when it completes the set (the caller then checks the aux data)."""
        self.chunks_seen.add(index)
        self.total_chunks = total_chunks or self.total_chunks
        self.progress_s = now_s
        self.times.notified_s = time.monotonic()
        self.state = advance(self.state, KVPoll.Transferring)
        return self.total_chunks > 0 and len(self.chunks_seen) >= self.total_chunks

    def complete(self, aux: AuxData | None) -> None:
        """Every chunk arrived; Success if the aux slot holds this room's record."""
        self.writer_done = True
        if aux is None or aux.room != self.room:
            self.fail(f"aux data missing or for another room ({aux})")
            return
        self._aux = aux
        self.state = advance(self.state, KVPoll.Success)
        self.times.success_s = time.monotonic()
