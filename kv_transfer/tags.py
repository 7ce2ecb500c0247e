"""Notification messages exchanged between managers (over the backend's notification channel).

Every message is ASCII ``kind|room|xfer_id|a|b``; ``xfer_id`` is chosen by the decode side per destination
so that a late message of an earlier use of the same room is never mistaken for the current one.

- ``chunk|room|xfer_id|chunk_index|total``: chunk ``chunk_index`` has landed (total = chunk count on the
  last chunk, 0 otherwise).
- ``abort|room|xfer_id|unsettled|reason``: the sender gave up; it will write nothing more for this room.
- ``cancel|room|xfer_id|0|reason``: the receiver gave up; the sender must stop and answer ``done``.
- ``done|room|xfer_id|unsettled|``: the sender has no write in flight for this room and will post none.

``unsettled`` (``UNSETTLED``, else 0): a write of this room failed, and with a transport that gives writes up
on a timeout part of it may still be on the way; the receiver fences the sender's connections
(``Transport.fence_incoming``) before it reuses the pages. A sender that predates it sends 0.
- ``hello|0|0|0|instance``: connection warm-up at handshake; ignored by the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

Room = int
#: ``index`` of an ``abort``/``done`` whose room had a failed write (see above).
UNSETTLED = 1
#: How a room's failure text starts when its sender (``KVSender.abort``) or its receiver
#: (``KVReceiver.abort``) gave it up; that text travels as the ``abort``/``cancel`` tag's ``text``, and the
#: side that reads it puts its own words in front instead (``PrefillSide``, ``DecodeSide``), so a reason never
#: repeats the prefix.
ABORTED_BY_PREFILL = "aborted by prefill: "
ABORTED_BY_DECODE = "aborted by decode: "


class TagKind(str, Enum):
    CHUNK = "chunk"
    ABORT = "abort"
    CANCEL = "cancel"
    DONE = "done"
    HELLO = "hello"
    QUEUED = "queued"   # prefill → decode: the room waits in prefill's queue, and prefill is working
                        # through it


@dataclass(frozen=True)
class Tag:
    kind: TagKind
    room: Room
    xfer_id: str
    index: int = 0
    text: str = ""

    def encode(self) -> bytes:
        text = self.text.replace("|", "/")[:200]
        return f"{self.kind.value}|{self.room}|{self.xfer_id}|{self.index}|{text}".encode()

    @classmethod
    def decode(cls, data: bytes) -> Tag | None:
        """The tag in ``data``, or None for a message this protocol does not know (it is then ignored)."""
        try:
            kind, room, xfer_id, index, text = data.decode().split("|", 4)
            return cls(TagKind(kind), int(room), xfer_id, int(index), text)
        except (ValueError, UnicodeDecodeError):
            return None

    @property
    def total_chunks(self) -> int:
        """Chunk count carried by the last chunk's tag (0 on the others)."""
        return int(self.text) if self.kind == TagKind.CHUNK and self.text else 0


def chunk_tag(room: Room, xfer_id: str, chunk_index: int, total_chunks: int) -> Tag:
    return Tag(TagKind.CHUNK, room, xfer_id, chunk_index, str(total_chunks) if total_chunks else "")
