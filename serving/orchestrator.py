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
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from serving.request import GenerateRequest
from serving.stream import ResponseChunk, ResponseSink

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
        num_input_tokens: prompt length in tokens (0 when the response does not say).
        num_output_tokens: tokens generated so far, counted from the first token (prefill's response: 1;
            decode's responses include the first token in their count).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` on decode's last token, else ``None``.
        error: the child's error message, if it failed.
        final: the FINAL flag of the child stream.
    """

    text: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    final: bool = False


@dataclass
class OutputChunk:
    """What the pd_ensemble sends to its client in one response."""

    text: str
    final: bool
    finish_reason: str | None = None
    error: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class _MergeState:
    first_done: bool = False
    prefill_final: bool = False
    decode_final: bool = False
    held: list[ChildResponse] = field(default_factory=list)
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None

    def final_chunk(self, finish_reason: str | None) -> OutputChunk:
        return OutputChunk(text="", final=True, finish_reason=finish_reason,
                           num_input_tokens=self.num_input_tokens, num_output_tokens=self.num_output_tokens)


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


@dataclass(frozen=True)
class ChildCall:
    """One child request: ``role`` (``"prefill"``/``"decode"``) on ``model``, for ``room``, paired with
    ``prefill_model`` (the decode side writes its destination to that prefill instance)."""

    role: str
    model: str
    room: Room
    prefill_model: str


#: ``launch(call) -> iterable of ChildResponse`` sends one child request and yields its responses.
Launch = Callable[[ChildCall], Iterable[ChildResponse]]
#: ``abort_room(room, reason)`` tells both instances to drop the room (through the bootstrap service).
AbortRoom = Callable[[Room, str], None]


class PDOrchestrator:
    """Runs requests through a prefill/decode pair and merges the two child streams into one."""

    def __init__(self, pairing: RoundRobinPairing, rooms: RoomAllocator, abort_room: AbortRoom,
                 readers: Executor, idle_timeout_s: float = 300.0) -> None:
        """
        Args:
            pairing: picks the (prefill, decode) models of each request.
            rooms: allocates bootstrap rooms.
            abort_room: tells both instances to drop a room (called on errors and client cancels).
            readers: runs the two child-stream readers of each request (two threads per request in flight).
            idle_timeout_s: a request whose children say nothing for this long (seconds) is aborted and ends
                with an error, so that a lost child stream can never leave the client without FINAL. It must
                exceed the longest prefill (nothing streams while the prompt is computed).
        """
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self._pairing = pairing
        self._rooms = rooms
        self._abort_room = abort_room
        self._readers = readers
        self._idle_timeout_s = idle_timeout_s

    def generate(self, launch: Launch, emit: Callable[[OutputChunk], None],
                 is_cancelled: Callable[[], bool]) -> None:
        """Serve one request to its end; ``emit`` is called with the final chunk exactly once, last.

        Args:
            launch: sends one child request of this client request (it holds the client's inputs).
            emit: receives the client's chunks, in order, on this thread.
            is_cancelled: True once the client cancelled (polled every ``CANCEL_POLL_INTERVAL_S``).

        Blocks the calling thread until the request has ended for the client. Never raises: every failure
        becomes a final chunk with ``error`` set.
        """
        room = self._rooms.allocate()
        prefill_model, decode_model = self._pairing.next_pair()
        events: queue.Queue[tuple[str, ChildResponse]] = queue.Queue()
        try:
            self._start_reader(ChildCall("prefill", prefill_model, room, prefill_model), launch, events)
            self._start_reader(ChildCall("decode", decode_model, room, prefill_model), launch, events)
            final = self._merge(room, events, emit, is_cancelled)
        except Exception as exc:  # a bug here must still end the client's stream
            logger.exception("room=%d: orchestration failed", room)
            self._abort_room(room, f"orchestrator error: {exc}")
            final = OutputChunk(text="", final=True, error=f"internal error: {exc}")
        finally:
            self._rooms.release(room)
        emit(final)

    def _start_reader(self, call: ChildCall, launch: Launch, events: queue.Queue) -> None:
        def read() -> None:
            try:
                # read to the end even after an error response: a BLS response iterator left unfinished keeps
                # its child request alive, and the model then never unloads
                for response in launch(call):
                    events.put((call.role, response))
                events.put((call.role, ChildResponse(final=True)))
            except Exception as exc:
                logger.warning("room=%d: %s stream failed: %s", call.room, call.role, exc)
                events.put((call.role, ChildResponse(error=f"{call.role} failed: {exc}", final=True)))

        self._readers.submit(read)

    def _merge(self, room: Room, events: queue.Queue, emit: Callable[[OutputChunk], None],
               is_cancelled: Callable[[], bool]) -> OutputChunk:
        state = _MergeState()
        last_event_s = time.monotonic()
        while not (state.prefill_final and state.decode_final):
            if is_cancelled():
                self._abort_room(room, "cancelled by the client")
                return state.final_chunk("abort")
            try:
                role, response = events.get(timeout=CANCEL_POLL_INTERVAL_S)
            except queue.Empty:
                if time.monotonic() - last_event_s > self._idle_timeout_s:
                    reason = f"no response from prefill or decode for {self._idle_timeout_s:.0f} s"
                    logger.error("room=%d: %s (prefill_final=%s decode_final=%s)", room, reason,
                                 state.prefill_final, state.decode_final)
                    self._abort_room(room, reason)
                    return OutputChunk(text="", final=True, error=reason)
                continue
            last_event_s = time.monotonic()
            if response.error is not None:
                self._abort_room(room, f"{role}: {response.error}")
                return OutputChunk(text="", final=True, error=response.error)
            self._accept(role, response, state, emit)
        return state.final_chunk(state.finish_reason)

    def _accept(self, role: str, response: ChildResponse, state: _MergeState,
                emit: Callable[[OutputChunk], None]) -> None:
        if role == "prefill":
            state.prefill_final = state.prefill_final or response.final
            if not state.first_done and (response.num_output_tokens or response.final):
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
        state.num_input_tokens = max(state.num_input_tokens, response.num_input_tokens)
        state.num_output_tokens = max(state.num_output_tokens, response.num_output_tokens)
        if response.finish_reason is not None:
            state.finish_reason = response.finish_reason
        if response.text:
            emit(OutputChunk(text=response.text, final=False, num_input_tokens=state.num_input_tokens,
                             num_output_tokens=state.num_output_tokens))


class EnsembleResponder:
    """Turns the orchestrator's chunks into the client's responses (the Triton LLM convention).

    Streaming: one response per text delta, then a last response with the finish reason and FINAL.
    Non-streaming: one response, FINAL, with the whole text (the prompt first unless
    ``exclude_input_in_output``). An error: one error response, FINAL. A client cancel: FINAL alone.
    """

    def __init__(self, request: GenerateRequest, sink: ResponseSink) -> None:
        self._request = request
        self._sink = sink
        self._parts: list[str] = []

    def emit(self, chunk: OutputChunk) -> None:
        if chunk.error is not None:
            self._sink.send_error(chunk.error)
            return
        if chunk.final and chunk.finish_reason == "abort" and self._sink.is_cancelled():
            self._sink.close()
            return
        if self._request.stream:
            if chunk.text or chunk.final:
                self._sink.send(self._response(chunk.text, chunk), final=chunk.final)
            return
        self._parts.append(chunk.text)
        if chunk.final:
            prefix = self._request.prompt if self._request.echo_prompt else ""
            self._sink.send(self._response(prefix + "".join(self._parts), chunk), final=True)

    @staticmethod
    def _response(text: str, chunk: OutputChunk) -> ResponseChunk:
        return ResponseChunk(text=text, finish_reason=chunk.finish_reason if chunk.final else None,
                             num_input_tokens=chunk.num_input_tokens, num_output_tokens=chunk.num_output_tokens)
