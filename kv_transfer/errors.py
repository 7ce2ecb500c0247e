"""Typed errors of the KV transfer layer; each names the one room (or field) it concerns."""

from __future__ import annotations

Room = int


class KVTransferError(Exception):
    """Base class of every error this package raises."""


class TransferError(KVTransferError):
    """A transfer for one room failed; other rooms are unaffected."""

    def __init__(self, room: Room, reason: str) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason


class CompatibilityError(KVTransferError):
    """Two instances disagree on a field of the KV layout; raised at handshake, before any byte moves."""

    def __init__(self, field: str, ours: object, theirs: object, our_layout: str = "",
                 their_layout: str = "") -> None:
        both = f" (here: {our_layout}; peer: {their_layout})" if our_layout or their_layout else ""
        super().__init__(f"incompatible KV layout: {field} is {ours!r} here but {theirs!r} on the peer{both}")
        self.field = field
        self.ours = ours
        self.theirs = theirs
        self.our_layout = our_layout
        self.their_layout = their_layout
