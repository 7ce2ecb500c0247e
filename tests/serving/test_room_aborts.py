"""``RoomAborts`` follows the bootstrap's abort log with long polls: an abort shows within a fraction of the
long-poll wait, and ``stop`` returns within it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bootstrap import BootstrapClient, BootstrapServer, ServerConfig
from serving.room_aborts import RoomAborts


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    srv = BootstrapServer(ServerConfig(port=0))
    srv.start()
    yield srv
    srv.stop()


def test_an_abort_shows_without_waiting_for_the_long_poll_to_end(server: BootstrapServer) -> None:
    aborts = RoomAborts(server.url, "test", long_poll_s=5.0)   # a missed wake-up would take 5 s
    aborts.start()
    try:
        time.sleep(0.3)   # the first long poll is held by now
        BootstrapClient(server.url).abort_room(31, "cancelled")
        deadline = time.monotonic() + 2.0
        while not aborts.is_aborted(31):
            assert time.monotonic() < deadline, "abort not seen within 2 s"
            time.sleep(0.01)
        assert not aborts.is_aborted(32)
    finally:
        started = time.monotonic()
        aborts.stop(timeout_s=10.0)
        assert time.monotonic() - started < 6.0
