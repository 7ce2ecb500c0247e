"""``Member`` (one fleet member as the membership store holds it) and ``MembershipView`` (a reader's view).

A member's JSON is versioned (``MEMBER_VERSION``); a reader refuses another version with a clear error
instead of guessing at fields.

Signed records: with a fleet secret, a member carries ``signature``, ``bootstrap.auth.record_mac`` of kind
``"member"`` over ``Member.payload()`` (its sorted JSON without the signature: version, instance id, role,
address, model name, rendezvous URL, epoch). The writer signs (``signed``), every reader checks (``check``),
so a store others can write (etcd without auth, an open or compromised registry) cannot add a member or
change one's address: only holders of the fleet secret make a record a reader accepts. Version history:
1, no signature; 2, ``signature`` (``""`` when the fleet has no secret).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from bootstrap.auth import AuthError, check_record_mac, record_mac

MEMBER_VERSION = 2
ROLES = ("prefill", "decode", "router")
RECORD_KIND = "member"   # the domain of a member's signature (``bootstrap.auth.record_mac``)
_TEXT_FIELDS = ("instance_id", "role", "address", "model_name", "rendezvous_url", "signature")


class MembershipError(Exception):
    """A membership message or setting we cannot use (bad URL, wrong version, bad field, refused by the
    store)."""


class MemberSignatureError(MembershipError):
    """A member record is unsigned, or not signed by this fleet's secret over its content."""


@dataclass(frozen=True)
class Member:
    """One fleet member.

    ``instance_id``: ``"<model>@<host:grpc port>"`` (routers: ``"router@<host:port>/<uuid>"``), the store's
    key. ``address``: the Triton gRPC endpoint ``"host:port"`` serving ``model_name``.
    ``rendezvous_url``: ``"http://host:port"`` of the instance's own rendezvous server (``""`` for routers).
    ``epoch``: changes on every process start (``time.time_ns()``); an older epoch never replaces a newer one.
    ``signature``: ``record_mac`` of the fleet secret over ``payload()`` (64 hex digits), ``""`` unsigned; not
    part of equality (the same member, signed or not, compares equal).
    Raises ``MembershipError`` at construction for an empty id, an unknown role, a text field that is not a
    ``str`` or an epoch that is not an ``int``.
    """

    instance_id: str
    role: str
    address: str
    model_name: str
    rendezvous_url: str
    epoch: int
    signature: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            if not isinstance(getattr(self, name), str):
                value = getattr(self, name)
                raise MembershipError(f"member field {name} must be a string, got {value!r:.80}")
        if not self.instance_id:
            raise MembershipError("member instance_id is empty")
        if self.role not in ROLES:
            raise MembershipError(
                f"member {self.instance_id}: role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool):
            raise MembershipError(f"member {self.instance_id}: epoch must be an int, got {self.epoch!r}")

    def to_dict(self) -> dict[str, object]:
        """The JSON object of this member, ``version`` and ``signature`` included."""
        return {"version": MEMBER_VERSION, **asdict(self)}

    def payload(self) -> bytes:
        """The signed bytes: the member's JSON without ``signature``, keys sorted, no spaces (UTF-8)."""
        content = {k: v for k, v in self.to_dict().items() if k != "signature"}
        return json.dumps(content, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def signed(self, secret: bytes | None) -> Member:
        """This member signed with the fleet ``secret``; itself, unchanged, when ``secret`` is None."""
        if secret is None:
            return self
        return replace(self, signature=record_mac(secret, RECORD_KIND, self.payload()))

    def check(self, secret: bytes) -> None:
        """Raises ``MemberSignatureError`` unless ``signature`` is the fleet ``secret``'s over ``payload()``
        (constant-time compare): unsigned, another secret's, or a field changed after signing."""
        try:
            check_record_mac(secret, RECORD_KIND, self.payload(), self.signature)
        except AuthError as exc:
            raise MemberSignatureError(str(exc)) from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: object) -> Member:
        """Raises ``MembershipError`` on another version, a missing or extra field, or a bad value (a missing
        ``signature`` reads as ``""``, unsigned). Checks no signature: that is ``check``'s."""
        if not isinstance(data, dict):
            raise MembershipError(f"a member must be a JSON object, got {type(data).__name__}")
        fields = dict(data)
        version = fields.pop("version", None)
        if version != MEMBER_VERSION:
            raise MembershipError(f"member version {version!r:.16} is not {MEMBER_VERSION} (version 2: "
                                  "signed members): every process of the fleet must run the same release")
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
