"""The ``Membership`` contract, and three thread-safe pieces both backends compose: the view they publish
(``ViewState``), the members this process announces (``Announcements``) and what a reader accepts from its
store (``MemberCheck``: signed records)."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from bootstrap.membership.member import Member, MembershipError, MembershipView, MemberSignatureError


class Membership(ABC):
    """Fleet membership as one process sees and shapes it. One per process; thread-safe.

    Lifecycle: construct (starts nothing) -> ``announce`` any time -> ``start()`` (its own named daemon
    threads) -> ``view()`` as often as wanted -> ``stop()``. A store that is unreachable never makes a method
    raise: announcing keeps retrying on the thread (one log line per outage) and the view stays the last one
    read, with ``fresh=False``.
    """

    @abstractmethod
    def start(self) -> None:
        """Starts the background thread(s); returns at once (the first read happens on the thread)."""

    @abstractmethod
    def stop(self, timeout_s: float = 5.0) -> None:
        """Withdraws every announced member from the store (best effort, bounded by ``timeout_s``) and ends
        the threads. Idempotent."""

    @abstractmethod
    def announce(self, member: Member, ttl_s: float = 10.0) -> None:
        """Keeps ``member`` registered while this process lives: its registration expires ``ttl_s`` seconds
        after the last renewal, which the thread sends about every ``ttl_s / 3``. It registers again after the
        store lost it (restarted empty, lease expired). Announcing the same ``instance_id`` again replaces the
        entry. With a fleet secret the store gets the member signed (``Member.signed``). Non-blocking; raises
        ``MembershipError`` only for ``ttl_s`` < 1."""

    @abstractmethod
    def withdraw(self, instance_id: str) -> None:
        """Stops announcing ``instance_id`` and removes it from the store (on the thread, within one tick).
        Unknown ids are ignored. Non-blocking."""

    @abstractmethod
    def view(self) -> MembershipView:
        """The fleet as last read; never blocks on the network. With a fleet secret it lists only records
        signed with it (``MemberCheck``); the others are left out and logged."""


class ViewState:
    """The published view: replaced whole on every successful read, marked stale on a failed one.

    ``mark_failed`` logs once per outage (at WARNING, with the reason) and ``publish`` logs the recovery."""

    def __init__(self, logger: logging.Logger, store: str) -> None:
        self._logger = logger
        self._store = store
        self._lock = threading.Lock()
        self._view = MembershipView((), False, 0.0)
        self._outage = False

    def get(self) -> MembershipView:
        with self._lock:
            return self._view

    def publish(self, members: Iterable[Member]) -> None:
        ordered = tuple(sorted(members, key=lambda m: m.instance_id))
        with self._lock:
            self._view = MembershipView(ordered, True, time.monotonic())
            recovered, self._outage = self._outage, False
        if recovered:
            self._logger.warning("membership store %s reachable again: %d members", self._store, len(ordered))

    def touch(self) -> None:
        """The store answered but nothing changed: the view is fresh as of now."""
        with self._lock:
            self._view = MembershipView(self._view.members, True, time.monotonic())
            recovered, self._outage = self._outage, False
        if recovered:
            self._logger.warning("membership store %s reachable again", self._store)

    def mark_failed(self, reason: str) -> None:
        with self._lock:
            self._view = MembershipView(self._view.members, False, self._view.updated_s)
            first, self._outage = not self._outage, True
        if first:
            self._logger.warning("membership store %s failed (%s): keeping the last view of %d members "
                                 "and retrying", self._store, reason, len(self._view.members))


@dataclass
class Announced:
    """One announced member and its renewal state, owned by the backend's thread once started."""

    member: Member
    ttl_s: float
    registered: bool = False      # the store holds it (as far as we know)
    renew_at_s: float = 0.0       # time.monotonic() of the next renewal
    lease_id: int = 0             # etcd only: the lease the key is attached to (0: none yet)


class Announcements:
    """The members this process announces and the ids it withdrew but has not yet removed from the store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, Announced] = {}
        self._withdrawn: dict[str, Announced] = {}

    def add(self, member: Member, ttl_s: float) -> None:
        if ttl_s < 1.0:
            raise MembershipError(f"announce {member.instance_id}: ttl_s must be >= 1, got {ttl_s}")
        with self._lock:
            old = self._entries.get(member.instance_id)
            self._entries[member.instance_id] = Announced(member, ttl_s, lease_id=old.lease_id if old else 0)
            self._withdrawn.pop(member.instance_id, None)

    def remove(self, instance_id: str) -> None:
        with self._lock:
            entry = self._entries.pop(instance_id, None)
            if entry is not None:
                self._withdrawn[instance_id] = entry

    def drop(self, instance_id: str) -> None:
        """Forgets an entry without withdrawing it (the store holds a newer epoch for its id)."""
        with self._lock:
            self._entries.pop(instance_id, None)

    def entries(self) -> list[Announced]:
        with self._lock:
            return list(self._entries.values())

    def take_withdrawn(self) -> list[Announced]:
        with self._lock:
            withdrawn, self._withdrawn = list(self._withdrawn.values()), {}
            return withdrawn

    def take_all(self) -> list[Announced]:
        """Every entry, announced or withdrawn (for ``stop``); leaves nothing behind."""
        with self._lock:
            everything = list(self._entries.values()) + list(self._withdrawn.values())
            self._entries, self._withdrawn = {}, {}
            return everything


#: How many refused (instance id, reason) pairs ``MemberCheck`` remembers, to log each once; past it, it
#: forgets them all (a store flooded with forged ids costs log lines, never unbounded memory).
MAX_REFUSALS_LOGGED = 1024


class MemberCheck:
    """What a reader accepts from its store, the check that counts whatever the store is: a record that
    parses as a ``Member`` of this version, is signed with the fleet ``secret`` (when one is set; without one
    nothing is signed or checked), sits under its own instance id (a signed record copied to another key is
    refused), and is not older than an epoch of that id this reader accepted before (a replayed record of an
    earlier process). A refused record is left out and logged at WARNING once per (instance id, reason) with
    its key and the reason; ``accept`` never raises. Thread-safe."""

    def __init__(self, secret: bytes | None, logger: logging.Logger, store: str) -> None:
        self._secret = secret
        self._logger = logger
        self._store = store
        self._lock = threading.Lock()
        self._epochs: dict[str, int] = {}          # instance id -> highest epoch accepted
        self._logged: set[tuple[str, str]] = set()  # (instance id or key, reason) already logged

    def sign(self, member: Member) -> Member:
        """``member`` signed with the fleet secret (unchanged without one)."""
        return member.signed(self._secret)

    def accept(self, record: object, key: str, key_id: str | None = None) -> Member | None:
        """The member of ``record`` (a JSON object, or the JSON text of one), or None when refused.

        ``key``: where the store holds it (for the log line). ``key_id``: the instance id the key names
        (etcd: the key without the prefix), which must be the record's; None where the store keys records by
        their own id (the registry's table)."""
        try:
            if isinstance(record, (str, bytes)):
                member = Member.from_json(record)
            else:
                member = Member.from_dict(record)
        except MembershipError as exc:
            self._refuse(key_id or key, key, "unreadable", str(exc))
            return None
        reason = self._reason(member, key_id)
        if reason is not None:
            self._refuse(member.instance_id, key, *reason)
            return None
        with self._lock:
            self._epochs[member.instance_id] = max(member.epoch, self._epochs.get(member.instance_id, 0))
        return member

    def genuine(self, member: Member) -> bool:
        """Whether ``member`` carries this fleet's signature (always True without a secret); logs nothing."""
        try:
            if self._secret is not None:
                member.check(self._secret)
            return True
        except MemberSignatureError:
            return False

    def _reason(self, member: Member, key_id: str | None) -> tuple[str, str] | None:
        if self._secret is not None:
            try:
                member.check(self._secret)
            except MemberSignatureError as exc:
                return ("unsigned" if not member.signature else "bad signature"), str(exc)
        if key_id is not None and key_id != member.instance_id:
            return "moved", f"the record of {member.instance_id!r} is under the key of {key_id!r}"
        with self._lock:
            newest = self._epochs.get(member.instance_id, 0)
        if member.epoch < newest:
            return "old epoch", (f"epoch {member.epoch} is older than epoch {newest} read before (a replayed "
                                 "record of an earlier process)")
        return None

    def _refuse(self, instance_id: str, key: str, kind: str, reason: str) -> None:
        with self._lock:
            if (instance_id, kind) in self._logged:
                return
            if len(self._logged) >= MAX_REFUSALS_LOGGED:
                self._logged.clear()
            self._logged.add((instance_id, kind))
        self._logger.warning("ignoring the member record at %s of %s: %s", key, self._store, reason)
