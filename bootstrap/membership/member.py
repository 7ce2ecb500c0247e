"""``Member`` (one fleet member as the membership store holds it) and ``MembershipView`` (a reader's view).

A member's JSON is versioned (``MEMBER_VERSION``); a reader refuses another version with a clear error
instead of guessing at fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

MEMBER_VERSION = 1
ROLES = ("prefill", "decode", "router")


class MembershipError(Exception):
    """A membership message or setting we cannot use (bad URL, wrong version, bad field, refused by the store)."""


@dataclass(frozen=True)
class Member:
    """One fleet member.

    ``instance_id``: ``"<model>@<host:grpc port>"`` (routers: ``"router@<host:port>/<uuid>"``), the store's key.
    ``address``: the Triton gRPC endpoint ``"host:port"`` serving ``model_name``.
    ``rendezvous_url``: ``"http://host:port"`` of the instance's own rendezvous server (``""`` for routers).
    ``epoch``: changes on every process start (``time.time_ns()``); an older epoch never replaces a newer one.
    """

    instance_id: str
    role: str
    address: str
    model_name: str
    rendezvous_url: str
    epoch: int

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise MembershipError("member instance_id is empty")
        if self.role not in ROLES:
            raise MembershipError(f"member {self.instance_id}: role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool):
            raise MembershipError(f"member {self.instance_id}: epoch must be an int, got {self.epoch!r}")

    def to_dict(self) -> dict[str, object]:
        """The JSON object of this member, ``version`` included."""
        return {"version": MEMBER_VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: object) -> Member:
        """Raises ``MembershipError`` on another version, a missing or extra field, or a bad value."""
        if not isinstance(data, dict):
            raise MembershipError(f"a member must be a JSON object, got {type(data).__name__}")
        fields = dict(data)
        version = fields.pop("version", None)
        if version != MEMBER_VERSION:
            raise MembershipError(f"member version {version!r} is not {MEMBER_VERSION}: every process of the "
                                  "fleet must run the same release")
        try:
            return cls(**fields)
        except TypeError as exc:
            raise MembershipError(f"bad member fields {sorted(fields)}: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise MembershipError(f"a member is not JSON: {exc}") from exc
        return cls.from_dict(data)


@dataclass(frozen=True)
class MembershipView:
    """What one process knows of the fleet.

    ``members``: sorted by ``instance_id``. ``fresh``: the last contact with the store succeeded (False: this
    is the last known view, frozen until the store answers again). ``updated_s``: ``time.monotonic()`` of the
    last successful read (0.0 before the first).
    """

    members: tuple[Member, ...]
    fresh: bool
    updated_s: float

    def by_role(self, role: str) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.role == role)
