"""Admission control of the router: at most ``max_inflight`` requests orchestrated at once, at most
``max_queued`` waiting behind them for up to ``queue_timeout_s``; beyond that a request is refused at once
with ``ServerBusy`` (SGLang's gateway answers HTTP 429 the same way). Waiters are admitted first come, first
served.

Event loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ServerBusy(Exception):
    """The router is at its admission bound; the request was not started (the client may retry later)."""


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float) -> None:
        if max_inflight <= 0 or max_queued < 0 or queue_timeout_s <= 0:
            raise ValueError("Admission needs max_inflight > 0, max_queued >= 0, queue_timeout_s > 0")
        self._max_inflight = max_inflight
        self._max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self._inflight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one in-flight slot for the body. Raises ``ServerBusy`` when the queue is full or the wait
        exceeded ``queue_timeout_s``; a cancelled waiter gives its place up."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self._inflight < self._max_inflight and not self._waiters:
            self._inflight += 1
            return
        if len(self._waiters) >= self._max_queued:
            raise ServerBusy(f"server busy: {self._inflight} requests in flight and {len(self._waiters)} "
                             f"queued (max_inflight_requests={self._max_inflight}, max_queued_requests="
                             f"{self._max_queued}); retry later")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if waiter.done() and not waiter.cancelled():
                self._release()    # admitted just as the wait ended: hand the slot on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ServerBusy(f"server busy: not admitted within queue_timeout_s={self._queue_timeout_s:g} s "
                             f"({self._inflight} requests in flight); retry later") from None

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)   # the slot passes to the waiter: inflight stays the same
                return
        self._inflight -= 1
