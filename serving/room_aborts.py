"""Rooms the orchestrator aborted (client cancel, the other half failed), as seen by a prefill or decode worker.

Triton's BLS in tritonserver 2.51 cannot cancel a child request, so ``pd_ensemble`` posts the room's abort to the
bootstrap service and every PD worker follows the service's abort log: ``RoomAborts`` long-polls it on its own
thread (one HTTP call held open up to ``long_poll_s`` and answered as soon as a room is aborted; never on the
engine loop thread) and answers ``is_aborted(room)`` from memory. The same log names routers whose lease ended
(they died or stopped): ``router_gone(router_id)`` is then True, and the workers drop every room that router
opened. Aborted rooms and gone routers are forgotten after ``retain_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError

logger = logging.getLogger(__name__)
K = TypeVar("K")


class RoomAborts:
    """The abort log of the bootstrap service, followed on a background thread."""

    def __init__(self, bootstrap_url: str, name: str, poll_interval_s: float = 0.02, retain_s: float = 120.0,
                 http_timeout_s: float = 2.0, busy: Callable[[], bool] | None = None,
                 idle_poll_interval_s: float = 0.25, long_poll_s: float = 1.0) -> None:
        """Starts nothing.

        Args:
            bootstrap_url: the bootstrap service (``http://host:port``).
            name: thread name suffix (the worker's instance name).
            poll_interval_s: pause after an empty answer that came back early while ``busy()``, seconds (a
                service that does not hold long polls: then this is the polling period).
            retain_s: how long an aborted room is remembered, seconds.
            http_timeout_s: timeout of each HTTP call beyond the long poll's wait, seconds.
            busy: True while the worker holds requests (picks ``poll_interval_s`` or ``idle_poll_interval_s``).
            idle_poll_interval_s: the same pause while not busy, seconds.
            long_poll_s: how long the service may hold one call, seconds; ``stop()`` can take this long.
        """
        self._url = bootstrap_url
        self._name = name
        self._poll_interval_s = poll_interval_s
        self._retain_s = retain_s
        self._http_timeout_s = http_timeout_s
        self._busy = busy or (lambda: True)
        self._idle_poll_interval_s = idle_poll_interval_s
        self._long_poll_s = long_poll_s
        self._aborted: dict[int, float] = {}
        self._gone_routers: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("RoomAborts already started")
        self._thread = threading.Thread(target=self._run, name=f"room-aborts-{self._name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def is_aborted(self, room: int) -> bool:
        with self._lock:
            return room in self._aborted

    def router_gone(self, router_id: str) -> bool:
        """True when the router ``router_id`` lost its lease (empty id: the request named no router)."""
        if not router_id:
            return False
        with self._lock:
            return router_id in self._gone_routers

    def mark(self, room: int) -> None:
        """Record an abort seen by other means (tests, or the same process's orchestrator)."""
        with self._lock:
            self._aborted[room] = time.monotonic()

    def _run(self) -> None:
        client = BootstrapClient(self._url, timeout_s=self._http_timeout_s)
        after = -1
        try:
            while not self._stop.is_set():
                asked_s = time.monotonic()
                try:
                    log = client.aborted_rooms(after, wait_s=self._long_poll_s)
                except BootstrapError as e:
                    logger.debug("%s: abort log not reachable: %s", self._name, e)
                    self._stop.wait(min(1.0, 20 * self._poll_interval_s))
                    continue
                after = log.last_seq
                now = time.monotonic()
                with self._lock:
                    for room in log.rooms:
                        self._aborted[room] = now
                    for router_id in log.routers:
                        logger.warning("%s: router %s is gone; its rooms are dropped", self._name, router_id)
                        self._gone_routers[router_id] = now
                    _forget_older(self._aborted, now - self._retain_s)
                    _forget_older(self._gone_routers, now - self._retain_s)
                news = log.rooms or log.routers
                if not news and now - asked_s < self._long_poll_s / 2:   # not held: pace the polls
                    self._stop.wait(self._poll_interval_s if self._busy() else self._idle_poll_interval_s)
        finally:
            client.close()


def _forget_older(seen: dict[K, float], cutoff_s: float) -> None:
    """Drop the entries of ``seen`` (key → time seen) older than ``cutoff_s``."""
    for key in [k for k, t in seen.items() if t < cutoff_s]:
        del seen[key]
