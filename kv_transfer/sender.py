"""Prefill side, one ``KVSender`` per request (room).

Lifecycle of a room on the prefill side:
1. ``manager.create_sender(room)``                  → Bootstrapping (waiting for decode's destination)
2. the manager thread fetches the destination from the bootstrap, handshakes with the decode instance
   (compatibility checked before any byte moves)    → WaitingForInput
3. ``init(num_pages)`` (any time after 1); then one ``send(page_ids, is_last, aux)`` per prefill chunk;
   the thread posts each chunk as one WRITE tagged ``chunk|room|xfer_id|index|total``  → Transferring
4. every WRITE confirmed done, the last one carrying the aux data  → Success
Failure at any step (bootstrap timeout, decode cancelled, decode lost, a WRITE failed, ``abort``) → Failed;
the source pages may be freed once ``pages_releasable()`` (no WRITE still reads them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bootstrap.messages import Destination
from kv_transfer.aux import AuxData
from kv_transfer.base import BaseKVSender
from kv_transfer.errors import TransferError
from kv_transfer.layout import PageId
from kv_transfer.peers import Peer
from kv_transfer.poll import KVPoll, advance
from kv_transfer.tags import ABORTED_BY_PREFILL, Tag, TagKind
from kv_transfer.timings import SenderTimings

Room = int


@dataclass(frozen=True)
class Chunk:
    """One ``send`` call: ``src_pages`` go to destination pages ``[dst_start, dst_start + len)``."""

    index: int
    src_pages: list[PageId]
    dst_start: int
    is_last: bool
    aux: AuxData | None


class KVSender(BaseKVSender):
    """Handle of one room on the prefill side. Every method is cheap and thread-safe (one manager lock).

    The attributes below the public methods are owned by the manager thread (read/written under the lock).
    """

    def __init__(self, room: Room, lock: threading.RLock, wake: threading.Event, created_s: float,
                 post_now: Callable[[KVSender], None] | None = None, page_size: int = 1) -> None:
        self.room = room
        self._page_size = page_size
        self._lock = lock
        self._wake = wake
        self._post_now = post_now               # inline progress: posts queued chunks in the caller's thread
        self.created_s = created_s
        self.state = KVPoll.Bootstrapping
        self._failure: TransferError | None = None
        self.num_pages: int | None = None
        self.last_page_tokens: int | None = None   # tokens of a partly filled last prompt page
                                                   # (None: full/unknown)
        self.destination: Destination | None = None
        self.peer: Peer | None = None
        self.queued: deque[Chunk] = deque()
        self.inflight: list[object] = []
        self.posting = 0                        # chunks taken off the queue whose WRITE is being posted
        self.pages_assigned = 0
        self.next_chunk = 0
        self.last_queued = False
        self.last_posted = False
        self.pending_notif: Tag | None = None   # sent to decode once no WRITE is in flight
        self.write_failed = False               # a WRITE of this room ended in ERR: part of it may
                                                # still arrive
        # VRAM mode: the aux WRITE, after the KV one
        self.aux_post: tuple[np.ndarray, np.ndarray, Tag] | None = None
        self.local_aux_slot: int | None = None   # staging slot of the aux bytes while the last WRITE runs
        self.closed = False                     # the manager dropped this room
        self.times = SenderTimings()            # written under the lock; ``timings`` copies it

    # --- caller API (serving layer) ---------------------------------------------------------------------
    def poll(self) -> KVPoll:
        with self._lock:
            return self.state

    @property
    def failure(self) -> TransferError | None:
        with self._lock:
            return self._failure

    @property
    def timings(self) -> SenderTimings:
        """A copy of this room's timestamps (see ``kv_transfer.timings``)."""
        with self._lock:
            return SenderTimings(**vars(self.times))

    def init(self, num_pages: int, num_tokens: int | None = None) -> None:
        """Declares how many pages (and, when known, tokens) the prompt's KV spans. Raises ``TransferError``
        if they disagree, or the destination (with the pages decode already holds) does not match."""
        with self._lock:
            if num_pages <= 0:
                raise self._fail_and_raise(f"init with {num_pages} pages")
            if num_tokens is not None and -(-num_tokens // self._page_size) != num_pages:
                raise self._fail_and_raise(f"{num_tokens} tokens do not span {num_pages} pages of "
                                           f"{self._page_size}")
            self.num_pages = num_pages
            partial = num_tokens - (num_pages - 1) * self._page_size if num_tokens is not None else None
            self.last_page_tokens = partial if partial is not None and partial < self._page_size else None
            reason = self._destination_mismatch()
            if reason is not None:
                raise self._fail_and_raise(reason)

    @property
    def num_skipped_pages(self) -> int:
        """Leading prompt pages decode already holds (its prefix cache): never written. Lock held or not: the
        destination is set once."""
        dest = self.destination
        return dest.num_cached_tokens // self._page_size if dest is not None else 0

    def _destination_mismatch(self) -> str | None:
        """Lock held: why the destination cannot take this room's ``num_pages`` (None when it can, or while
        either is unknown). Both sides agree on every count before a byte moves."""
        dest = self.destination
        if dest is None or self.num_pages is None:
            return None
        skip, have = self.num_skipped_pages, len(dest.dst_page_ids)
        if dest.num_cached_tokens % self._page_size:
            return (f"decode holds {dest.num_cached_tokens} cached tokens, not a multiple of the page size "
                    f"{self._page_size}")
        if skip >= self.num_pages:
            return (f"decode holds {dest.num_cached_tokens} cached tokens ({skip} pages) of a prompt of "
                    f"{self.num_pages} pages: the last page must be sent")
        if have < self.num_pages - skip:
            return (f"destination has {have} pages after {skip} cached ones, prompt needs {self.num_pages}")
        return None

    def send(self, page_ids: Sequence[PageId], is_last: bool, aux: AuxData | None = None) -> None:
        """Queues one chunk; the manager thread posts it, so the copy overlaps the next chunk's forward pass.
        The last chunk (``is_last``), which the first token waits for, is posted before ``send`` returns when
        ``KVArgs.inline_progress`` is on and the destination is known (with any chunk still queued): no thread
        hop. Host memory over UCX ``cma`` copies inside that post: ~1 ms for the 5.6 MiB of a 128-token
        SmolLM2 prompt, so the caller's thread is held for the last chunk's copy (and that of any chunk still
        queued because the destination came late); on GPU memory it only posts. ``aux`` is required with
        ``is_last``.

        Non-final chunks carry whole pages only; the final chunk adds the partial last page. A no-op on a
        Failed room. Raises ``TransferError`` (and fails the room) on a call that breaks these rules.
        """
        with self._lock:
            if self.state == KVPoll.Failed:
                return
            total = self.pages_assigned + len(page_ids)
            if self.num_pages is None or self.last_queued:
                raise self._fail_and_raise("send before init" if self.num_pages is None
                                           else "send after last")
            if total > self.num_pages or (is_last and total != self.num_pages):
                raise self._fail_and_raise(f"chunk brings the page count to {total} of {self.num_pages}")
            if is_last and aux is None:
                raise self._fail_and_raise("the last chunk needs aux data")
            self.queued.append(Chunk(self.next_chunk, list(page_ids), self.pages_assigned, is_last, aux))
            self.times.send_s = time.monotonic()
            self.pages_assigned, self.next_chunk, self.last_queued = total, self.next_chunk + 1, is_last
            post_now = self._post_now if self.destination is not None and is_last else None
        if post_now is not None:
            post_now(self)
        self._wake.set()   # the manager thread tracks the WRITE to completion (or posts it)

    def abort(self, reason: str) -> None:
        """Gives the room up; the decode side learns it and ends Failed too. Idempotent."""
        with self._lock:
            self.fail(ABORTED_BY_PREFILL + reason, notify_peer=True)
        self._wake.set()

    def pages_releasable(self) -> bool:
        """True when the room is terminal and no WRITE still reads the source pages."""
        with self._lock:
            return self.state.is_terminal and not self.inflight and not self.queued and not self.posting

    # --- manager thread ---------------------------------------------------------------------------------
    def fail(self, reason: str, notify_peer: bool = False) -> None:
        """Moves to Failed (sticky) and drops queued chunks; lock held by the caller."""
        if self.state.is_terminal:
            return
        self.state = advance(self.state, KVPoll.Failed)
        self._failure = TransferError(self.room, reason)
        self.queued.clear()
        if notify_peer and self.destination is not None:
            self.pending_notif = Tag(TagKind.ABORT, self.room, self.destination.xfer_id, 0, reason)

    def attach(self, destination: Destination, peer: Peer) -> None:
        """The decode side's destination arrived; lock held by the caller."""
        self.destination, self.peer = destination, peer
        reason = self._destination_mismatch()
        if reason is not None:
            self.fail(reason, notify_peer=True)
            return
        self.state = advance(self.state, KVPoll.WaitingForInput)

    def _fail_and_raise(self, reason: str) -> TransferError:
        self.fail(reason, notify_peer=True)
        self._wake.set()
        return TransferError(self.room, reason)
