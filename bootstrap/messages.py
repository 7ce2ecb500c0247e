"""Typed, versioned JSON messages of the bootstrap rendezvous (no pickle; agent metadata travels base64).

Every message travels in an envelope ``{"version", "schema", "type", "body"}``. ``version`` is
``PROTOCOL_VERSION``; ``schema`` is a hash over every message's field names, so two builds that disagree on a
message shape refuse each other's messages instead of misreading them. Version history: docs/protocol.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from bootstrap.errors import BootstrapError

PROTOCOL_VERSION = 1
MAX_ROOM = 2**63 - 1
Room = int


@dataclass(frozen=True)
class Registration:
    """One engine instance's entry: who it is, how to reach its NIXL agent, what its KV pool looks like.

    ``epoch`` changes on every start of the instance; ``agent_name`` is unique per epoch. ``kv_info`` is the
    KV layer's own JSON (layout, model id, region addresses); the bootstrap never interprets it.
    """

    instance_id: str
    role: str
    epoch: int
    agent_name: str
    agent_metadata_b64: str
    compat_hash: str
    address: str = ""
    kv_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")

    @property
    def agent_metadata(self) -> bytes:
        return base64.b64decode(self.agent_metadata_b64)

    @staticmethod
    def encode_metadata(metadata: bytes) -> str:
        return base64.b64encode(metadata).decode()


@dataclass(frozen=True)
class Heartbeat:
    instance_id: str
    epoch: int


@dataclass(frozen=True)
class Destination:
    """Where prefill instance ``prefill_instance_id`` must write room ``room``'s KV (posted by decode)."""

    room: Room
    prefill_instance_id: str
    decode_instance_id: str
    decode_agent_name: str
    xfer_id: str
    dst_page_ids: list[int]
    aux_slot: int

    def __post_init__(self) -> None:
        if not 0 <= self.room <= MAX_ROOM:
            raise ValueError(f"room {self.room} is not a 63-bit id")


ACCEPTED, ROOM_IN_USE, UNKNOWN_INSTANCE = "accepted", "room_in_use", "unknown_instance"


@dataclass(frozen=True)
class PostResult:
    """Answer to a posted destination: ``code`` (one of ACCEPTED, ROOM_IN_USE, UNKNOWN_INSTANCE), a reason for
    people, and the prefill instance's current agent (so decode notices a restart since its handshake)."""

    room: Room
    code: str
    reason: str = ""
    prefill_agent_name: str = ""

    @property
    def accepted(self) -> bool:
        return self.code == ACCEPTED


@dataclass(frozen=True)
class DestinationBatch:
    """Every destination posted for one prefill instance since its previous fetch."""

    destinations: list[Destination]


@dataclass(frozen=True)
class RoomRelease:
    room: Room
    decode_instance_id: str


@dataclass(frozen=True)
class RoomReleased:
    """``delivered``: the prefill instance had already fetched the destination (it may be writing)."""

    room: Room
    known: bool
    delivered: bool


@dataclass(frozen=True)
class RoomAbort:
    """A third party (the orchestrator) gives room ``room`` up; workers follow the abort log."""

    room: Room
    reason: str = ""


@dataclass(frozen=True)
class AbortLog:
    """Rooms aborted after the cursor the caller sent; ``last_seq`` is the cursor for the next call."""

    rooms: list[Room]
    last_seq: int


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    Registration, Heartbeat, Destination, PostResult, DestinationBatch, RoomRelease, RoomReleased, RoomAbort,
    AbortLog)}
_SCHEMA = {name: [f.name for f in fields(cls)] for name, cls in sorted(MESSAGE_TYPES.items())}
SCHEMA_HASH = hashlib.sha256(json.dumps(_SCHEMA).encode()).hexdigest()[:12]

M = TypeVar("M")


def encode(message: Any) -> bytes:
    """The one encoder: dataclass message → JSON envelope bytes."""
    envelope = {"version": PROTOCOL_VERSION, "schema": SCHEMA_HASH,
                "type": type(message).__name__, "body": asdict(message)}
    return json.dumps(envelope).encode()


def decode(data: bytes | str, expected: type[M]) -> M:
    """The one decoder. Raises ``BootstrapError`` on a version/schema mismatch, wrong type or bad body."""
    try:
        envelope = json.loads(data)
    except ValueError as exc:
        raise BootstrapError(f"not a JSON message: {exc}") from exc
    if envelope.get("version") != PROTOCOL_VERSION or envelope.get("schema") != SCHEMA_HASH:
        raise BootstrapError(f"protocol mismatch: peer speaks version {envelope.get('version')} schema "
                             f"{envelope.get('schema')}, we speak {PROTOCOL_VERSION} schema {SCHEMA_HASH}")
    if envelope.get("type") != expected.__name__:
        raise BootstrapError(f"expected {expected.__name__}, got {envelope.get('type')}")
    return _build(expected, envelope.get("body"))


def _build(cls: type[M], body: Any) -> M:
    try:
        if cls is DestinationBatch:
            return cls([Destination(**d) for d in body["destinations"]])  # type: ignore[call-arg]
        return cls(**body)
    except (TypeError, KeyError, ValueError) as exc:
        raise BootstrapError(f"bad {cls.__name__} body: {exc}") from exc
