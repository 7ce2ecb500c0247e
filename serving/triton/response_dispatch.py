"""``ResponseDispatcher``: the one thread of a model instance that talks to Triton's response senders.

Why: in tritonserver 2.51 both ``response_sender.send()`` and ``response_sender.is_cancelled()`` are round
trips to the server process (the stub waits for the backend's answer). A send blocks for as long as the server
does not take the response — for a child of a BLS parent whose stub died or stalls, forever (the parent's
message queue is full). Called on the engine loop thread, that froze a worker with every request it held. So
engine loops (and the router's event loop) only enqueue; this thread sends, in order, and polls cancellation
every ``cancel_poll_interval_s`` for every open stream, caching the answer for ``is_cancelled`` to read. A
stuck transport then stalls responses, never the engine: requests still finish, time out or get aborted, and
their pages come back.

Ordering and FINAL: operations of one stream run in the order they were queued; the dispatcher never touches
a sender after it sent FINAL (tritonserver 2.51 crashed on ``is_cancelled()`` after FINAL). ``stop`` drains
the queue (the errors and FINALs of failing requests still go out) within its deadline.

Stream batching: a stream that fell behind (several of its responses queued when the thread comes to it) has
its queued chunk responses (``submit_chunk``) merged into one by ``merge`` (``serving.delta.merge_chunks``:
texts, tokens and logprobs joined), so the sends, and the work of every hop after this one, shrink with the
backlog; a stream that keeps up still gets one response per chunk, and nothing waits to be merged (the first
token is never delayed). Streams take turns in the order their first queued response arrived.

Triton-free: it drives anything with ``send(response=None, flags=0)`` and ``is_cancelled()``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)


class RawSender(Protocol):
    """``pb_utils.InferenceResponseSender`` as the dispatcher uses it."""

    def send(self, response: Any = None, flags: int = 0) -> None: ...

    def is_cancelled(self) -> bool: ...


Chunk = TypeVar("Chunk")


@dataclass(frozen=True)
class _Op(Generic[Chunk]):
    build: Callable[[], Any] | None   # None (and no chunk): FINAL flag alone
    final: bool
    flags: int
    chunk: Chunk | None = None        # a mergeable response: make(chunk) builds it
    make: Callable[[Chunk], Any] | None = None


class StreamHandle:
    """One stream's state shared by its producer and the dispatcher thread (``cancelled`` is cached)."""

    def __init__(self, sender: RawSender, name: str) -> None:
        self.sender = sender
        self.name = name
        self.cancelled = False
        self.done = False          # FINAL sent (dispatcher thread)
        self.pending: deque[_Op[Any]] = deque()   # queued, not sent (under the dispatcher's lock)
        self.scheduled = False     # in the dispatcher's ready queue (under the dispatcher's lock)


class ResponseDispatcher:
    """Sends responses and polls cancellation on its own thread. The constructor starts nothing."""

    def __init__(self, name: str, final_flag: int, cancel_poll_interval_s: float = 0.05,
                 merge: Callable[[Any, Any], Any] | None = None) -> None:
        """
        Args:
            name: thread name suffix (the model instance).
            final_flag: ``pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL``.
            cancel_poll_interval_s: how often open streams are asked ``is_cancelled()``, seconds.
            merge: (earlier chunk, later chunk) → one chunk saying both, for queued ``submit_chunk`` responses
                of one stream; None: never merge.
        """
        self._name = name
        self._final_flag = final_flag
        self._poll_s = cancel_poll_interval_s
        self._merge = merge
        # streams with pending responses; SimpleQueue (C, no Condition): one put per response on the engine's
        # thread and one get on this one, both under the GIL the engine shares with this thread
        self._ready: queue.SimpleQueue[StreamHandle | None] = queue.SimpleQueue()
        self._lock = threading.Lock()   # every handle's pending and scheduled
        self._open: dict[int, StreamHandle] = {}
        self._open_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.merged_total = 0   # responses saved by merging (dispatcher thread; for tests and diagnostics)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("ResponseDispatcher already started")
        self._thread = threading.Thread(target=self._run, name=f"responses-{self._name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Send what is queued, then end the thread; False if it did not finish within ``timeout_s``."""
        self._stop.set()
        self._ready.put(None)
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("responses-%s: %d responses still queued after %.1f s", self._name, self.queued,
                         timeout_s)
            return False
        return True

    def open(self, sender: RawSender, name: str = "") -> StreamHandle:
        """Start following one stream's cancellation; any thread."""
        handle = StreamHandle(sender, name)
        with self._open_lock:
            self._open[id(handle)] = handle
        return handle

    def submit(self, handle: StreamHandle, build: Callable[[], Any] | None, final: bool) -> None:
        """Queue one response (``build()`` makes it on the dispatcher thread; None: the FINAL flag alone); any
        thread."""
        self._enqueue(handle, _Op(build, final, self._final_flag if final else 0))

    def submit_chunk(self, handle: StreamHandle, chunk: Chunk, make: Callable[[Chunk], Any],
                     final: bool) -> None:
        """Queue one response that may be merged with the stream's queued chunk responses next to it
        (``make(chunk)`` builds it on the dispatcher thread; of a merged run, the last one's ``make`` builds
        the merged chunk); any thread."""
        self._enqueue(handle, _Op(None, final, self._final_flag if final else 0, chunk, make))

    def _enqueue(self, handle: StreamHandle, op: _Op[Any]) -> None:
        with self._lock:
            handle.pending.append(op)
            if handle.scheduled:
                return
            handle.scheduled = True
        self._ready.put(handle)

    @property
    def queued(self) -> int:
        """Responses queued and not sent yet (any thread)."""
        with self._open_lock:
            handles = list(self._open.values())
        with self._lock:
            return sum(len(h.pending) for h in handles)

    def open_streams(self) -> list[str]:
        """Names of the streams that have not sent FINAL yet (any thread; for diagnostics)."""
        with self._open_lock:
            return [h.name for h in self._open.values() if not h.done]

    def _run(self) -> None:
        next_poll_s = time.monotonic() + self._poll_s
        while True:
            timeout_s = max(0.0, next_poll_s - time.monotonic())
            try:
                handle = self._ready.get(timeout=timeout_s)
            except queue.Empty:
                handle = None
            if handle is not None:
                with self._lock:
                    ops, handle.pending = list(handle.pending), deque()
                    handle.scheduled = False
                for op in self._coalesce(ops):
                    self._send(handle, op)
            elif self._stop.is_set() and self._ready.empty():
                return
            if time.monotonic() >= next_poll_s:
                self._poll_cancelled()
                next_poll_s = time.monotonic() + self._poll_s

    def _coalesce(self, ops: list[_Op[Any]]) -> list[_Op[Any]]:
        """``ops`` with each run of consecutive chunk responses merged into one (a run ends with a final one;
        ops after a final op are left for ``_send``, which drops them: the stream is done)."""
        if self._merge is None:
            return ops
        out: list[_Op[Any]] = []
        for op in ops:
            last = out[-1] if out else None
            if (last is not None and last.chunk is not None and op.chunk is not None and not last.final):
                try:
                    merged = self._merge(last.chunk, op.chunk)
                except Exception:
                    logger.exception("responses-%s: merging two responses failed; sending both", self._name)
                else:
                    out[-1] = _Op(None, op.final, op.flags, merged, op.make)
                    self.merged_total += 1
                    continue
            out.append(op)
        return out

    def _send(self, handle: StreamHandle, op: _Op[Any]) -> None:
        if handle.done:
            return
        try:
            if op.chunk is not None and op.make is not None:
                handle.sender.send(op.make(op.chunk), flags=op.flags)
            elif op.build is None:
                handle.sender.send(flags=op.flags)
            else:
                handle.sender.send(op.build(), flags=op.flags)
        except Exception:
            logger.exception("request %s: sending a response failed", handle.name)
        if op.final:
            handle.done = True
            with self._open_lock:
                self._open.pop(id(handle), None)

    def _poll_cancelled(self) -> None:
        with self._open_lock:
            handles = [h for h in self._open.values() if not h.cancelled]
        for handle in handles:
            if handle.done:
                continue
            try:
                handle.cancelled = bool(handle.sender.is_cancelled())
            except Exception:
                logger.exception("request %s: is_cancelled failed", handle.name)
