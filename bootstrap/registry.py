"""Registry state of one instance's rendezvous: pure bookkeeping, no I/O, time passed in by the caller.

Each PD instance hosts its own rendezvous (``bootstrap.rendezvous``), so its registry holds one registration,
its own (kept fresh by the instance's load reports), and, on a prefill instance, the rooms decode instances
posted to it. Lifecycle of a room:
1. decode posts a ``Destination`` for room R to prefill instance P (rejected if R is in use, or P is not the
   prefill instance registered here);
2. P takes its batch of new destinations; R is marked delivered;
3. decode releases R when its receiver is done (or has failed); R may then be used again.
A room also disappears when P re-registers with a new epoch (a restart), and after ``room_ttl_s`` in any case,
so a crashed decode cannot leak it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bootstrap.messages import (
    ACCEPTED,
    ROOM_IN_USE,
    UNKNOWN_INSTANCE,
    Destination,
    InstanceLoad,
    InstanceStatus,
    PostResult,
    Registration,
    Room,
    RoomReleased,
)


@dataclass(frozen=True)
class RegistryConfig:
    registration_ttl_s: float = 10.0   # an instance that has not heartbeated for this long is dropped
    room_ttl_s: float = 600.0          # a room record older than this is dropped

    def __post_init__(self) -> None:
        if self.registration_ttl_s <= 0 or self.room_ttl_s <= 0:
            raise ValueError("RegistryConfig TTLs must be positive")


@dataclass
class _Instance:
    registration: Registration
    last_seen_s: float
    draining: bool = False


@dataclass
class _RoomRecord:
    destination: Destination
    created_s: float
    delivered: bool = False


class Registry:
    """Instances and rooms. Not thread-safe: the server calls it from its one event loop."""

    def __init__(self, config: RegistryConfig) -> None:
        self._config = config
        self._instances: dict[str, _Instance] = {}
        self._rooms: dict[Room, _RoomRecord] = {}

    def register(self, registration: Registration, now_s: float) -> None:
        old = self._instances.get(registration.instance_id)
        if old is not None and old.registration.epoch != registration.epoch:
            self._drop_rooms_of(registration.instance_id)
        self._instances[registration.instance_id] = _Instance(registration, now_s)

    def heartbeat(self, instance_id: str, epoch: int, now_s: float, load: InstanceLoad | None = None) -> bool:
        """False when the instance (this epoch) is unknown: it must register again. ``load`` replaces the
        reported load (None keeps it)."""
        entry = self._instances.get(instance_id)
        if entry is None or entry.registration.epoch != epoch:
            return False
        entry.last_seen_s = now_s
        if load is not None:
            entry.registration = replace(entry.registration, load=load)
        return True

    def set_draining(self, instance_id: str, epoch: int) -> bool:
        """Mark the instance (this epoch) as draining in every listing from now on
        (``InstanceStatus.draining``). False when that epoch is not registered."""
        entry = self._instances.get(instance_id)
        if entry is None or entry.registration.epoch != epoch:
            return False
        entry.draining = True
        return True

    def deregister(self, instance_id: str, epoch: int, now_s: float = 0.0) -> bool:
        entry = self._instances.get(instance_id)
        if entry is None or entry.registration.epoch != epoch:
            return False
        self._drop(instance_id, now_s)
        return True

    def instances(self, now_s: float, role: str = "") -> list[InstanceStatus]:
        """Every registered instance (of ``role`` when given), without agent metadata, oldest id first."""
        return [InstanceStatus(r.instance_id, r.role, r.epoch, r.address, r.model_name, r.load,
                               max(0.0, now_s - e.last_seen_s), r.rendezvous_url,
                               r.worker_endpoint, e.draining)
                for e in sorted(self._instances.values(), key=lambda e: e.registration.instance_id)
                for r in (e.registration,) if not role or r.role == role]

    def get(self, instance_id: str) -> Registration | None:
        entry = self._instances.get(instance_id)
        return entry.registration if entry else None

    def post_destination(self, destination: Destination, now_s: float) -> PostResult:
        """Take room ``destination.room``'s destination for its prefill instance. The same destination posted
        again (a decode retrying a post whose answer was lost: a link down) is accepted again and still
        delivered once; another one for a room in use is refused (``ROOM_IN_USE``), as is an unknown prefill
        instance."""
        prefill = self._instances.get(destination.prefill_instance_id)
        if prefill is None or prefill.registration.role != "prefill":
            return PostResult(destination.room, UNKNOWN_INSTANCE,
                              f"unknown prefill instance {destination.prefill_instance_id}")
        record = self._rooms.get(destination.room)
        if record is not None:
            if record.destination == destination:   # the same post again: its first answer was lost
                return PostResult(destination.room, ACCEPTED, "", prefill.registration.agent_name)
            return PostResult(destination.room, ROOM_IN_USE, f"room {destination.room} is already in use")
        self._rooms[destination.room] = _RoomRecord(destination, now_s)
        return PostResult(destination.room, ACCEPTED, "", prefill.registration.agent_name)

    def take_destinations(self, prefill_instance_id: str) -> list[Destination]:
        """Every not-yet-delivered destination for this prefill instance; each is delivered exactly once."""
        batch = []
        for record in self._rooms.values():
            if not record.delivered and record.destination.prefill_instance_id == prefill_instance_id:
                record.delivered = True
                batch.append(record.destination)
        return batch

    def release_room(self, room: Room, decode_instance_id: str) -> RoomReleased:
        record = self._rooms.get(room)
        if record is None or record.destination.decode_instance_id != decode_instance_id:
            return RoomReleased(room, known=False, delivered=False)
        del self._rooms[room]
        return RoomReleased(room, known=True, delivered=record.delivered)

    def expire(self, now_s: float) -> list[str]:
        """Drop silent instances (and their rooms) and stale rooms; returns the dropped instance ids."""
        ttl_s = self._config.registration_ttl_s
        dead = [i for i, e in self._instances.items() if now_s - e.last_seen_s > ttl_s]
        for instance_id in dead:
            self._drop(instance_id, now_s)
        for room in [r for r, rec in self._rooms.items() if now_s - rec.created_s > self._config.room_ttl_s]:
            del self._rooms[room]
        return dead

    def _drop(self, instance_id: str, now_s: float) -> None:
        self._instances.pop(instance_id)
        self._drop_rooms_of(instance_id)

    @property
    def num_instances(self) -> int:
        return len(self._instances)

    @property
    def num_rooms(self) -> int:
        return len(self._rooms)

    def _drop_rooms_of(self, instance_id: str) -> None:
        for room in [r for r, rec in self._rooms.items() if instance_id in
                     (rec.destination.prefill_instance_id, rec.destination.decode_instance_id)]:
            del self._rooms[room]
