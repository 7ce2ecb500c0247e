"""Typed, versioned JSON messages of the rendezvous (no pickle; agent metadata travels base64).

Every PD instance hosts its own rendezvous server (``bootstrap.rendezvous``): its registration, and the rooms
decode instances post to it when it is a prefill instance. Peers reach it at ``Registration.rendezvous_url``.

Every message travels in an envelope ``{"version", "schema", "type", "body"}``. ``version`` is
``PROTOCOL_VERSION``; ``schema`` is a hash over every message's field names, so two builds that disagree on a
message shape refuse each other's messages instead of misreading them. Version history: docs/protocol.md.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from bootstrap.errors import BootstrapError

PROTOCOL_VERSION = 9
MAX_ROOM = 2**63 - 1
Room = int


ROLES: tuple[str, ...] = ("prefill", "decode")
#: Roles that hold a KV pool (and a NIXL agent): every role that has a rendezvous.
KV_ROLES: tuple[str, ...] = ROLES


@dataclass(frozen=True)
class InstanceLoad:
    """What an engine instance reports with every heartbeat (the router pairs by it).

    Attributes:
        num_queued_requests: requests waiting in the instance's queues (prefill: bootstrap + waiting;
            decode: prealloc + transfer).
        num_running_requests: requests in the engine's running batch.
        num_queued_prompt_tokens: prompt tokens not yet prefilled, summed over queued and running requests.
        num_free_pages: free pages of the KV pool.
        num_total_pages: pages of the KV pool.
        page_size: tokens per page.
        rank_free_pages: a DP-attention instance (``enable_dp_attention``): free pages of each rank's pool,
            rank 0 first (``num_free_pages`` is their sum; one request's pages all lie in one rank's pool);
            empty for an instance of one pool.
        rank_queued_prompt_tokens: a DP-attention instance: ``num_queued_prompt_tokens`` split by the rank
            each request runs on, rank 0 first (a request not placed on a rank yet counts on none); empty for
            an instance of one pool. With ``rank_free_pages``, what a router chooses a request's rank by.
    """

    num_queued_requests: int = 0
    num_running_requests: int = 0
    num_queued_prompt_tokens: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    page_size: int = 0
    rank_free_pages: list[int] = field(default_factory=list)
    rank_queued_prompt_tokens: list[int] = field(default_factory=list)

    @property
    def largest_free_pages(self) -> int:
        """Most pages one request can take: the freest rank's (``num_free_pages`` for one pool)."""
        return max(self.rank_free_pages) if self.rank_free_pages else self.num_free_pages


@dataclass(frozen=True)
class Registration:
    """One instance's entry: who it is, where Triton serves it, how to reach its NIXL agent, its KV layout.

    ``epoch`` changes on every start of the instance; ``agent_name`` is unique per epoch. ``address`` is the
    Triton gRPC endpoint (``host:port``) that serves ``model_name``: the router sends requests there.
    ``kv_info`` is the KV layer's own JSON (layout, model id, region addresses); the rendezvous never
    interprets it. ``rendezvous_url`` (``http://host:port``) is the instance's own rendezvous server, where
    peers fetch this registration and decode instances post destinations. ``worker_endpoint`` (``host:port``;
    empty: none) is the worker's own endpoint for ``model_name`` alone, in child frames over TCP
    (``serving.workers.endpoint``, ``serving.child.frames``; protocol version 6): routers send its child
    requests there, past tritonserver.
    """

    instance_id: str
    role: str
    epoch: int
    agent_name: str
    agent_metadata_b64: str
    compat_hash: str
    address: str = ""
    kv_info: dict[str, Any] = field(default_factory=dict)
    model_name: str = ""
    load: InstanceLoad = field(default_factory=InstanceLoad)
    rendezvous_url: str = ""
    worker_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def agent_metadata(self) -> bytes:
        return base64.b64decode(self.agent_metadata_b64)

    @staticmethod
    def encode_metadata(metadata: bytes) -> str:
        return base64.b64encode(metadata).decode()


@dataclass(frozen=True)
class Heartbeat:
    """``load``: the instance's load now (None: unchanged, e.g. a router)."""

    instance_id: str
    epoch: int
    load: InstanceLoad | None = None


@dataclass(frozen=True)
class InstanceStatus:
    """One entry of the fleet listing: a registration without its agent metadata, and its freshness.

    ``age_s``: seconds since the rendezvous last heard from the instance (its own load report, every
    ``KVArgs.heartbeat_interval_s``: 1 s by default). ``draining``: the instance's model is being unloaded (a
    reload or an unload): it ends the streams it has and takes no new ones; routers pair it no more, and a
    router that found it through its server's repository index asks that model again (a reloaded successor
    answers there).
    """

    instance_id: str
    role: str
    epoch: int
    address: str
    model_name: str
    load: InstanceLoad
    age_s: float
    rendezvous_url: str = ""
    worker_endpoint: str = ""   # Registration.worker_endpoint
    draining: bool = False


@dataclass(frozen=True)
class InstanceList:
    """Every registered instance (``GET /v1/instances``), optionally of one role."""

    instances: list[InstanceStatus]


@dataclass(frozen=True)
class Destination:
    """Where prefill instance ``prefill_instance_id`` must write room ``room``'s KV (posted by decode to the
    prefill instance's own rendezvous). ``decode_rendezvous_url`` is decode's rendezvous server: prefill
    fetches decode's registration there for the handshake and checks there that decode is still alive.

    ``num_cached_tokens`` (a multiple of the page size, below the prompt length): the leading prompt tokens
    whose KV decode already holds (its prefix cache); prefill writes only the prompt's pages from page
    ``num_cached_tokens // page_size`` on, page ``i`` of the prompt into ``dst_page_ids[i - that]``.
    """

    room: Room
    prefill_instance_id: str
    decode_instance_id: str
    decode_agent_name: str
    xfer_id: str
    dst_page_ids: list[int]
    aux_slot: int
    num_cached_tokens: int = 0
    decode_rendezvous_url: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.room <= MAX_ROOM:
            raise ValueError(f"room {self.room} is not a 63-bit id")
        if self.num_cached_tokens < 0:
            raise ValueError(f"num_cached_tokens {self.num_cached_tokens} is negative")
        if self.aux_slot < 0 or any(page < 0 for page in self.dst_page_ids):
            raise ValueError("aux_slot and dst_page_ids must be non-negative")


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


MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    Registration, Heartbeat, Destination, PostResult, DestinationBatch, RoomRelease, RoomReleased,
    InstanceLoad, InstanceStatus, InstanceList)}
_SCHEMA = {name: [f.name for f in fields(cls)] for name, cls in sorted(MESSAGE_TYPES.items())}
SCHEMA_HASH = hashlib.sha256(json.dumps(_SCHEMA).encode()).hexdigest()[:12]

M = TypeVar("M")


def encode(message: Any) -> bytes:
    """The one encoder: dataclass message → JSON envelope bytes."""
    envelope = {"version": PROTOCOL_VERSION, "schema": SCHEMA_HASH,
                "type": type(message).__name__, "body": asdict(message)}
    return json.dumps(envelope).encode()


#: Page ids one destination may list: a 1M-token prompt at page size 16. More is refused as malformed.
MAX_DESTINATION_PAGES = 65536


def decode(data: bytes | str, expected: type[M]) -> M:
    """The one decoder. Raises ``BootstrapError`` on a version/schema mismatch, wrong type or bad body: a body
    that is not a JSON object, a field of the wrong JSON type (a list where an int belongs, a string for a
    list of page ids, ``true`` for a number), a missing or unknown field, or more than
    ``MAX_DESTINATION_PAGES`` page ids. Hostile input gets this error (HTTP 400 on the rendezvous), never
    another exception."""
    try:
        envelope = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BootstrapError(f"not a JSON message: {exc}") from exc
    if not isinstance(envelope, dict):
        raise BootstrapError(f"a message must be a JSON object envelope, got {type(envelope).__name__}")
    if envelope.get("version") != PROTOCOL_VERSION or envelope.get("schema") != SCHEMA_HASH:
        raise BootstrapError(f"protocol mismatch: peer speaks version {str(envelope.get('version'))[:16]} "
                             f"schema {str(envelope.get('schema'))[:16]}, we speak {PROTOCOL_VERSION} schema "
                             f"{SCHEMA_HASH}")
    if envelope.get("type") != expected.__name__:
        raise BootstrapError(f"expected {expected.__name__}, got {str(envelope.get('type'))[:64]}")
    return _build(expected, envelope.get("body"))


def _check(cls: type, body: Any) -> dict[str, Any]:
    """``body`` as the keyword arguments of ``cls``, each value checked against the field's declared type;
    nested messages built. Raises ``BootstrapError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise BootstrapError(f"bad {cls.__name__} body: a JSON object is required, got {type(body).__name__}")
    hints = _hints(cls)
    unknown = sorted(set(body) - set(hints))
    if unknown:
        raise BootstrapError(f"bad {cls.__name__} body: unknown fields {unknown[:8]}")
    return {name: _value(cls, name, hints[name], value) for name, value in body.items()}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(cls: type, name: str, hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint(**_check(hint, value))
    if origin is list:
        if not isinstance(value, list):
            raise BootstrapError(
                f"bad {cls.__name__} body: {name} must be a list, got {type(value).__name__}")
        if name == "dst_page_ids" and len(value) > MAX_DESTINATION_PAGES:
            raise BootstrapError(f"bad {cls.__name__} body: {len(value)} {name}, more than "
                                 f"{MAX_DESTINATION_PAGES}")
        return [_value(cls, name, args[0], item) for item in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise BootstrapError(
                f"bad {cls.__name__} body: {name} must be an object, got {type(value).__name__}")
        return value
    expected = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}.get(hint)
    if expected is None:
        return value   # Any
    if not isinstance(value, expected) or (hint is not bool and isinstance(value, bool)):
        raise BootstrapError(
            f"bad {cls.__name__} body: {name} must be {hint.__name__}, got {type(value).__name__}")
    return float(value) if hint is float else value


def _build(cls: type[M], body: Any) -> M:
    try:
        return cls(**_check(cls, body))
    except (TypeError, KeyError, ValueError) as exc:
        raise BootstrapError(f"bad {cls.__name__} body: {exc}") from exc
