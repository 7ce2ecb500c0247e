"""The registry's state, pure: members with a TTL each, expiry, and the epoch rule. No I/O, no clock of its
own (callers pass ``now_s``, ``time.monotonic()``), no locking (the service calls it from its one event loop).

Epoch rule: a member's ``epoch`` changes on every process start, so the larger epoch is the live process. A
``put`` with an older epoch than the stored one is refused (a stale process must not replace its successor);
``keepalive`` and ``delete`` act only when the epoch matches, so a stopping old process cannot remove its
successor's entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from bootstrap.membership.member import Member


class PutResult(Enum):
    STORED = "stored"
    STALE_EPOCH = "stale_epoch"    # the table holds a newer epoch of this instance_id: nothing changed


@dataclass
class _Entry:
    member: Member
    ttl_s: float
    expires_s: float


class MemberTable:
    """Members keyed by ``instance_id``; each lives ``ttl_s`` after its last ``put`` or ``keepalive``."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def put(self, member: Member, ttl_s: float, now_s: float) -> PutResult:
        old = self._entries.get(member.instance_id)
        if old is not None and old.member.epoch > member.epoch:
            return PutResult.STALE_EPOCH
        self._entries[member.instance_id] = _Entry(member, ttl_s, now_s + ttl_s)
        return PutResult.STORED

    def keepalive(self, instance_id: str, epoch: int, now_s: float) -> bool:
        """Renews the entry; False when the table has no entry of that id and epoch (the caller puts
        again)."""
        entry = self._entries.get(instance_id)
        if entry is None or entry.member.epoch != epoch or entry.expires_s <= now_s:
            return False
        entry.expires_s = now_s + entry.ttl_s
        return True

    def delete(self, instance_id: str, epoch: int) -> bool:
        """Removes the entry when its epoch is ``epoch``; False otherwise (absent, or another epoch)."""
        entry = self._entries.get(instance_id)
        if entry is None or entry.member.epoch != epoch:
            return False
        del self._entries[instance_id]
        return True

    def expire(self, now_s: float) -> list[Member]:
        """Removes and returns the members whose TTL ran out by ``now_s``."""
        dead = [e.member for e in self._entries.values() if e.expires_s <= now_s]
        for member in dead:
            del self._entries[member.instance_id]
        return dead

    def members(self, now_s: float) -> list[Member]:
        """The live members at ``now_s`` (expired ones are left out even before ``expire`` runs)."""
        return sorted((e.member for e in self._entries.values() if e.expires_s > now_s),
                      key=lambda m: m.instance_id)
