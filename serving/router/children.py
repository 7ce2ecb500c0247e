"""``ChildStreams``: the child streams one request has open, each read into one queue: by its own task, or,
where the launcher pushes (``PushLauncher``: worker endpoints), by the connection's reader directly.

The merge loop of ``PDOrchestrator`` reads ``(call, response)`` events with ``next_event``. A call that was
replaced (a migration cancels the open children and starts a direct decode elsewhere) may still have events in
the queue: ``is_current`` tells them apart, so the merge drops them.

Event loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from serving.delta import Delta, ErrorKind
from serving.router.launch import ChildCall, ChildUnavailable, Launcher, PushLauncher

logger = logging.getLogger(__name__)

Event = tuple[ChildCall, Delta]
#: How long ``cancel_all`` lets a child stream end by itself before cancelling it, seconds.
FINISH_GRACE_S = 0.1


class ChildStreams:
    """Starts child calls through ``launcher`` and cancels them; every stream ends with a FINAL event (an
    unreachable child or a broken stream becomes an ``ErrorKind.UNREACHABLE`` failure)."""

    def __init__(self, launcher: Launcher) -> None:
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None   # next_event waiting for an event
        self._launcher = launcher
        self._current: dict[str, ChildCall] = {}   # role -> its live call
        self._readers: list[asyncio.Future[None]] = []
        self._reader_of: dict[int, asyncio.Future[None]] = {}   # id(call) -> its reader

    def start(self, call: ChildCall) -> None:
        """Send ``call`` now; it becomes the current call of its role."""
        self._current[call.role] = call
        reader: asyncio.Future[None] | None = None
        if isinstance(self._launcher, PushLauncher):   # responses handed over by the connection's reader
            reader = self._launcher.push(call, lambda response: self._put((call, response)))
        if reader is None:
            reader = asyncio.ensure_future(self._read(call))
        self._readers.append(reader)
        self._reader_of[id(call)] = reader

    async def next_event(self, timeout_s: float) -> Event | None:
        """The oldest event not read yet, waiting up to ``timeout_s`` seconds for one; None when none came.
        One reader at a time (the merge loop). Runs once per streamed token: one future and one timer per
        wait, no task (``asyncio.wait_for`` on a queue's ``get`` made a task, a future and a timer for
        each)."""
        if not self._events:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._events.popleft() if self._events else None

    def _put(self, event: Event) -> None:
        self._events.append(event)
        if self._waiter is not None:
            _wake(self._waiter)

    def is_current(self, call: ChildCall) -> bool:
        """False for a call that was cancelled or replaced: its late events are stale."""
        return self._current.get(call.role) is call

    def forget(self, role: str) -> None:
        """Give up ``role``'s current call (its instance stopped answering: a frozen server, a host cut off
        from the router): its events become stale, and ``cancel_all`` no longer waits for it.

        A call to a worker's own endpoint (``Target.worker_endpoint``) is cancelled now: its ``CANCEL`` frame
        waits in the router's socket until the path is back, and the worker then aborts the request and frees
        its pages at once, also when what it waits for can no longer come (its prefill aborted the room while
        the link was down, and that abort never reached it: docs/multihost.md). A call through tritonserver is
        left to end by itself: a cancel that reached tritonserver 2.51 once the path was back, while the
        server's writes to this router were still stalled, aborted that server (a gRPC assertion,
        ``interceptor_common.h: ASSERTION FAILED: ops_``; docs/multihost.md); the instance's work for the
        request then runs to its end (its pages come back then, or at the waiting timeout)."""
        call = self._current.pop(role, None)
        reader = self._reader_of.pop(id(call), None) if call is not None else None
        if call is None or reader is None or reader not in self._readers:
            return
        self._readers.remove(reader)
        if call.target.worker_endpoint:
            reader.cancel()
        reader.add_done_callback(lambda r: r.cancelled() or r.exception())   # retrieved: no "never retrieved"

    async def cancel_all(self, grace_s: float = FINISH_GRACE_S) -> None:
        """End every open stream: one that ends by itself within ``grace_s`` (its FINAL already on its way,
        e.g. both children rejecting the same bad request) is left to end; the rest are cancelled (Triton
        cancels those children: they abort and free their pages). Waits for the readers; queued events of
        these calls become stale.

        Why the grace: a stream cancelled after the server sent its FINAL makes tritonserver 2.51's gRPC
        frontend keep that model loaded until the server's exit timeout (docs/healing.md section 4): a stop
        then took 20 s.
        """
        self._current.clear()
        self._reader_of.clear()
        readers, self._readers = self._readers, []
        pending = {reader for reader in readers if not reader.done()}
        if pending and grace_s > 0:
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        for reader in pending:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

    async def _read(self, call: ChildCall) -> None:
        try:
            async for response in self._launcher.stream(call):
                self._put((call, response))
                if response.final:
                    return
            self._put((call, Delta(final=True)))
        except ChildUnavailable as e:
            self._put((call, Delta.failure(str(e), ErrorKind.UNREACHABLE)))
        except asyncio.CancelledError:
            raise
        except Exception as e:   # a launcher bug fails this child, never the loop
            logger.exception("room=%d: %s stream failed", call.room, call.role)
            self._put((call, Delta.failure(f"{call.role} failed: {e}")))


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
