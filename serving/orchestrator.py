"""The pd_ensemble logic: one bootstrap room per request, a (prefill, decode) pair, two child streams merged.

Lifecycle of one request (``PDOrchestrator.generate``, run on a worker thread of the pd_ensemble model):

1. allocate a bootstrap room (a random 63-bit id, unique among the rooms in flight here);
2. pick the next (prefill model, decode model) pair, round robin over the configured models;
3. send the request to both concurrently (Triton BLS, decoupled); each child stream is read on its own thread
   into one queue;
4. forward the first token (prefill's response) as soon as it arrives, then decode's tokens in order (decode
   responses that arrive before prefill's are held back);
5. end with exactly one final chunk: on success, on the first child error, or when the client cancelled. On an
   error or a cancel the room is aborted through the bootstrap service, so both instances drop the request and
   free its pages; the child streams are still read to their end so that Triton can release them.

Triton BLS cannot cancel a child request in tritonserver 2.51 (python backend r24.10), which is why aborts go
through the rendezvous service that both instances already watch.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

Room = int
ROOM_BITS = 63

#: How often the merge loop wakes up to check for client cancellation, in seconds.
CANCEL_POLL_INTERVAL_S = 0.02


@dataclass(frozen=True)
class ChildResponse:
    """One response of a prefill or decode child request, converted from Triton tensors.

    Attributes:
        text: new text of this response (a UTF-8 delta; may be empty).
        num_tokens: tokens produced by this response.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` on decode's last token, else ``None``.
        error: the child's error message, if it failed.
        final: the FINAL flag of the child stream.
        transfer_ms: KV transfer time the prefill side measured (first chunk sent → all chunks acknowledged).
    """

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    final: bool = False
    transfer_ms: float | None = None


@dataclass
class OutputChunk:
    """What the pd_ensemble sends to its client in one response."""

    text: str
    final: bool
    finish_reason: str | None = None
    error: str | None = None
    num_output_tokens: int = 0


@dataclass
class _MergeState:
    first_done: bool = False
    prefill_final: bool = False
    decode_final: bool = False
    held: list[ChildResponse] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None


class RoomAllocator:
    """Hands out unique 63-bit bootstrap rooms (random, so that several orchestrators never collide in practice)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: set[Room] = set()

    def allocate(self) -> Room:
        with self._lock:
            while True:
                room = secrets.randbits(ROOM_BITS)
                if room not in self._in_flight:
                    self._in_flight.add(room)
                    return room

    def release(self, room: Room) -> None:
        with self._lock:
            self._in_flight.discard(room)

    def __len__(self) -> int:
        with self._lock:
            return len(self._in_flight)


class RoundRobinPairing:
    """Picks the next (prefill model, decode model) pair: 1P1D, 1P2D, 2P1D, ... on one server."""

    def __init__(self, prefill_models: list[str], decode_models: list[str]) -> None:
        if not prefill_models or not decode_models:
            raise ValueError("need at least one prefill model and one decode model")
        self._prefill = itertools.cycle(prefill_models)
        self._decode = itertools.cycle(decode_models)
        self._lock = threading.Lock()

    def next_pair(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefill), next(self._decode)


#: ``launch(model_name, room) -> iterable of ChildResponse`` sends one child request and yields its responses.
Launch = Callable[[str, Room], Iterable[ChildResponse]]
#: ``abort_room(room, reason)`` tells both instances to drop the room (through the bootstrap service).
AbortRoom = Callable[[Room, str], None]


class PDOrchestrator:
    """Runs requests through a prefill/decode pair and merges the two child streams into one."""

    def __init__(self, pairing: RoundRobinPairing, rooms: RoomAllocator, launch: Launch,
                 abort_room: AbortRoom, readers: Executor) -> None:
        self._pairing = pairing
        self._rooms = rooms
        self._launch = launch
        self._abort_room = abort_room
        self._readers = readers

    def generate(self, emit: Callable[[OutputChunk], None], is_cancelled: Callable[[], bool]) -> None:
        """Serve one request to its end; ``emit`` is called with the final chunk exactly once, last.

        Blocks the calling thread until the request has ended for the client. Never raises: every failure
        becomes a final chunk with ``error`` set.
        """
        room = self._rooms.allocate()
        prefill_model, decode_model = self._pairing.next_pair()
        events: queue.Queue[tuple[str, ChildResponse]] = queue.Queue()
        try:
            self._start_reader("prefill", prefill_model, room, events)
            self._start_reader("decode", decode_model, room, events)
            final = self._merge(room, events, emit, is_cancelled)
        except Exception as exc:  # a bug here must still end the client's stream
            logger.exception("room=%d: orchestration failed", room)
            self._abort_room(room, f"orchestrator error: {exc}")
            final = OutputChunk(text="", final=True, error=f"internal error: {exc}")
        finally:
            self._rooms.release(room)
        emit(final)

    def _start_reader(self, role: str, model: str, room: Room, events: queue.Queue) -> None:
        def read() -> None:
            try:
                for response in self._launch(model, room):
                    events.put((role, response))
                    if response.final:
                        return
                events.put((role, ChildResponse(final=True)))
            except Exception as exc:
                logger.warning("room=%d: %s stream failed: %s", room, role, exc)
                events.put((role, ChildResponse(error=f"{role} failed: {exc}", final=True)))

        self._readers.submit(read)

    def _merge(self, room: Room, events: queue.Queue, emit: Callable[[OutputChunk], None],
               is_cancelled: Callable[[], bool]) -> OutputChunk:
        state = _MergeState()
        while not (state.prefill_final and state.decode_final):
            if is_cancelled():
                self._abort_room(room, "cancelled by the client")
                return OutputChunk(text="", final=True, finish_reason="abort",
                                   num_output_tokens=state.num_tokens)
            try:
                role, response = events.get(timeout=CANCEL_POLL_INTERVAL_S)
            except queue.Empty:
                continue
            if response.error is not None:
                self._abort_room(room, f"{role}: {response.error}")
                return OutputChunk(text="", final=True, error=response.error)
            self._accept(role, response, state, emit)
        return OutputChunk(text="", final=True, finish_reason=state.finish_reason,
                           num_output_tokens=state.num_tokens)

    def _accept(self, role: str, response: ChildResponse, state: _MergeState,
                emit: Callable[[OutputChunk], None]) -> None:
        if role == "prefill":
            state.prefill_final = state.prefill_final or response.final
            if not state.first_done and (response.num_tokens or response.final):
                state.first_done = True
                self._forward(response, state, emit)
                for held in state.held:
                    self._forward(held, state, emit)
                state.held.clear()
            return
        state.decode_final = state.decode_final or response.final
        if state.first_done:
            self._forward(response, state, emit)
        else:
            state.held.append(response)

    @staticmethod
    def _forward(response: ChildResponse, state: _MergeState, emit: Callable[[OutputChunk], None]) -> None:
        state.num_tokens += response.num_tokens
        if response.finish_reason is not None:
            state.finish_reason = response.finish_reason
        if response.text or response.num_tokens:
            emit(OutputChunk(text=response.text, final=False, num_output_tokens=state.num_tokens))
