"""The typed KV transfer interfaces: what serving and the workers depend on, whatever backend moves the bytes.

Three handles sit above the byte-moving ``Transport`` (``kv_transfer.transport``):

- ``BaseKVManager``: one per engine instance (a prefill or a decode role); creates the per-request handles.
- ``BaseKVSender``: one per room on the prefill side; takes the prompt's pages chunk by chunk.
- ``BaseKVReceiver``: one per room on the decode side; gives the reserved destination pages, reports arrival.

Every handle reports an ordered ``KVPoll`` (``Failed`` < ``Bootstrapping`` < ``WaitingForInput`` <
``Transferring`` < ``Success``); ``Failed`` and ``Success`` are terminal and sticky, and a failure ends that
room only (``failure`` then holds a ``TransferError`` naming the room and the reason).

Threads: every method of the three handles is thread-safe and cheap (no network round trip; at most a post of
a WRITE with ``KVArgs.inline_progress``); callers are the serving layer's engine-loop and request threads. The
work behind them (destinations, handshakes, transfer tracking, timeouts) runs on the manager's own thread,
started by ``start`` and stopped by ``shutdown``.

Pages: the caller owns its KV pool (``KVArgs.kv_base_ptr``, laid out as ``kv_transfer.layout`` says) and every
page in it; it lends the pages of a room to the transfer and may reuse
them only once ``pages_releasable()`` is true.

A backend implements ``Transport`` and registers a factory by name in ``kv_transfer.backends``; the managers,
senders and receivers here are shared by every backend (``KVManager`` implements ``BaseKVManager``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from bootstrap.messages import InstanceLoad
from kv_transfer.aux import AuxData
from kv_transfer.errors import TransferError
from kv_transfer.layout import PageId
from kv_transfer.poll import KVPoll
from kv_transfer.timings import ReceiverTimings, SenderTimings

Room = int


class BaseKVSender(ABC):
    """Prefill side of one room. Made by ``BaseKVManager.create_sender``; lives until the room is terminal and
    ``pages_releasable()``; the caller then drops it."""

    room: Room

    @abstractmethod
    def poll(self) -> KVPoll:
        """The room's state; never blocks (takes the manager lock only)."""

    @property
    @abstractmethod
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless ``poll()`` is ``Failed``)."""

    @property
    @abstractmethod
    def timings(self) -> SenderTimings:
        """A copy of this room's timestamps (``time.monotonic`` seconds; None where not reached)."""

    @abstractmethod
    def init(self, num_pages: int, num_tokens: int | None = None) -> None:
        """Caller: the prefill worker, once, before the first ``send``. ``num_tokens``, when given, is the
        prompt's length: then only the filled token slots of a partly filled last page are written (the rest
        of that page holds no KV), so the bytes moved are the prompt's KV and nothing more. ``num_pages``
        (> 0) is the number of pages the prompt's KV spans (all of them, whatever decode holds already: the
        sender drops the leading pages decode's destination says it has cached, and sends only the rest).
        Raises ``TransferError`` (and fails the room) when ``num_pages`` <= 0 or disagrees with
        ``num_tokens``, or the destination decode published does not fit it (fewer pages than the uncached
        rest, or a cached count that is not page-aligned or covers the last page)."""

    @abstractmethod
    def send(self, page_ids: Sequence[PageId], is_last: bool, aux: AuxData | None = None) -> None:
        """Caller: the engine-loop thread, once per prefill chunk, after the chunk's forward pass wrote these
        pages. ``page_ids`` are local page ids (whole pages only, except that the last chunk carries the
        partial last page); they stay owned by the caller but must not be written or freed until
        ``pages_releasable()``. ``aux`` (first token and logprob) is required with ``is_last``. Returns once
        the chunk is queued (or, inline, posted); never waits for the bytes to land. A no-op on a Failed room.
        Raises ``TransferError`` (the room fails) on a call that breaks these rules."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Caller: any thread. Gives the room up; the decode side learns it and ends Failed. Idempotent."""

    @abstractmethod
    def pages_releasable(self) -> bool:
        """True once the room is terminal and no WRITE still reads its source pages: the caller may then free
        them."""


class BaseKVReceiver(ABC):
    """Decode side of one room. Made by ``BaseKVManager.create_receiver``; lives until the room is terminal
    and ``pages_releasable()``."""

    room: Room

    @abstractmethod
    def poll(self) -> KVPoll:
        """The room's state; never blocks for long (with inline progress it first drains arrived
        notifications, a few microseconds)."""

    @property
    @abstractmethod
    def failure(self) -> TransferError | None:
        """Why the room failed (None unless ``poll()`` is ``Failed``)."""

    @property
    @abstractmethod
    def aux(self) -> AuxData | None:
        """The first token id, its logprob and the room, set at ``Success``."""

    @property
    @abstractmethod
    def timings(self) -> ReceiverTimings:
        """A copy of this room's timestamps (``time.monotonic`` seconds)."""

    @abstractmethod
    def init(self, dst_page_ids: Sequence[PageId], num_cached_tokens: int = 0) -> None:
        """Caller: the decode worker, once. ``num_cached_tokens`` (a multiple of the page size, below the
        prompt length; 0 without a prefix cache) is how many leading prompt tokens decode already holds: their
        pages are decode's own and prefill never writes them. ``dst_page_ids`` are the local pages reserved
        for the rest of the prompt's KV, prompt page ``num_cached_tokens // page_size`` first (at least the
        prompt's remaining page count); prefill WRITEs into them, so the caller must not read or free them
        until ``pages_releasable()``. The prefill side checks both counts against its prompt before a byte
        moves (a mismatch fails the room on both sides). Raises ``TransferError`` when called twice, with no
        pages, or with ``num_cached_tokens`` negative or not page-aligned."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Caller: any thread. Gives the room up; the prefill side is told to stop writing. Idempotent."""

    @abstractmethod
    def pages_releasable(self) -> bool:
        """True once no WRITE can land in the destination pages any more (Success, or Failed with the writer
        known done or dead)."""


class BaseKVManager(ABC):
    """One per engine instance and role. Constructed cheaply (no threads, no I/O); ``start`` does the work.
    Public methods are thread-safe."""

    #: changes with every start of the instance (``time.time_ns()`` taken by ``start``); 0 before it
    epoch: int = 0

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """The transport agent's name, unique per process start (peers detect a restart by a new name)."""

    @abstractmethod
    def set_load_source(self, load: Callable[[], InstanceLoad | None]) -> None:
        """Caller: the worker factory, before ``start``. ``load()`` runs on the manager thread before each
        heartbeat; it must be cheap and thread-safe."""

    @abstractmethod
    def start(self) -> None:
        """Caller: the worker's start, once. Registers the KV memory with the transport (once, for the
        manager's lifetime), starts the instance's own rendezvous server and registers there, starts the
        manager thread. Raises ``BootstrapError`` (the rendezvous cannot listen), ``TransportError`` (the
        backend cannot start), ``RuntimeError`` (twice)."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Caller: the worker's stop. Idempotent; blocks at most ~``timeout_s``. Fails open rooms (peers are
        told), stops the rendezvous, closes the transport. The caller keeps the KV memory alive until it
        returned."""

    @abstractmethod
    def create_sender(self, room: Room) -> BaseKVSender:
        """Prefill role only (``TypeError`` otherwise): the sender of ``room``, ``Bootstrapping`` (or
        ``Failed`` at once when the room is open here already)."""

    @abstractmethod
    def create_receiver(self, room: Room, prefill_instance_id: str,
                        prefill_rendezvous_url: str) -> BaseKVReceiver:
        """Decode role only (``TypeError`` otherwise): the receiver of ``room``, fed by
        ``prefill_instance_id``, whose own rendezvous is at ``prefill_rendezvous_url`` (``http://host:port``,
        as the router learned it): the handshake, the destination and the release go there."""

    @property
    @abstractmethod
    def rendezvous_url(self) -> str:
        """This instance's own rendezvous (``http://host:port``; after ``start``): routers hand it to decode
        instances paired with this one."""

    @abstractmethod
    def metrics(self) -> dict[str, int]:
        """Counters (``kv_bytes_total``, ``transfers_total``, ``failed_rooms_total``,
        ``timed_out_rooms_total``, ...) and gauges (``open_rooms``, ``free_aux_slots``); a snapshot, safe from
        any thread."""
