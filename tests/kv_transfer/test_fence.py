"""A failed room's pages go back only when no late byte of its writer can land in them.

With Mooncake over TCP a write given up on a timeout can still be delivered after a partition heals, into
pages by then given to another request (docs/multihost.md "Late writes after a partition"). The prefill side
marks the ``abort``/``done`` of a room with a failed write (``tags.UNSETTLED``); the decode side then has its
transport fence that writer's connections (``Transport.fence_incoming``) before ``pages_releasable()`` turns
true, and does the same when the writer vanished. Here:

- the protocol, on the in-process transport with its two ends replaced: a prefill transport whose writes
  report ERR after their bytes landed, a decode transport that records fence calls and answers what the test
  says;
- the fence itself on plain sockets (``tcp_fence.fence_host``);
- Mooncake: a fence closes the engine's connections from the writer, and the next rooms still arrive whole.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from kv_harness import PAGE_SIZE, LocalSide, RemoteSide, SideWorker, wait_for

from kv_transfer import KVManager, KVPoll, tcp_fence
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.transport import XferState

TIMEOUT_S = 15.0
TIMEOUTS = {"bootstrap_timeout_s": 20.0, "waiting_timeout_s": 20.0}


class FailingWrites(InProcessTransport):
    """Prefill's transport: while ``failing``, every write reports ERR and its notification is not sent; its
    bytes land all the same (what a write given up on a timeout and delivered late looks like)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id)
        self.failing = False

    def post_write_spans(self, peer: str, local_spans: np.ndarray, remote_spans: np.ndarray,
                         notif: bytes) -> object:
        state = super().post_write_spans(peer, local_spans, remote_spans, b"" if self.failing else notif)
        return XferState.ERR if self.failing else state


class RecordingFence(InProcessTransport):
    """Decode's transport: records ``fence_incoming`` calls and answers ``fence_result``."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id)
        self.fence_result = True
        self.fence_calls: list[str] = []

    def fence_incoming(self, peer: str) -> bool:
        self.fence_calls.append(peer)
        return self.fence_result


def _side(role: str, name: str, transport: InProcessTransport) -> LocalSide:
    side = LocalSide(role, name, "inprocess", **TIMEOUTS)
    worker: SideWorker = side.worker
    worker.manager.shutdown()   # never started: swap in the test's transport
    worker.manager = KVManager(worker.args, transport)
    side.start_free = side.call("start")
    side.rendezvous_url = side.call("rendezvous_url")
    return side


@pytest.fixture
def ends() -> Any:
    failing, fence = FailingWrites("prefill-fence"), RecordingFence("decode-fence")
    prefill = _side("prefill", "prefill-fence", failing)
    decode = _side("decode", "decode-fence", fence)
    yield prefill, failing, decode, fence
    for side in (prefill, decode):
        with contextlib.suppress(Exception):   # a crashed side has nothing left to stop
            side.call("stop")


def _open(prefill: LocalSide, decode: LocalSide, room: int, pages: int = 3) -> None:
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, pages * PAGE_SIZE)
    prefill.call("open_sender", room, pages * PAGE_SIZE)
    wait_for(lambda: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S, "the destination")


def _ended(side: LocalSide, room: int) -> bool:
    return side.call("poll", room) in (KVPoll.Success, KVPoll.Failed)


def _releasable(side: LocalSide, room: int) -> bool:
    return bool(side.worker.rooms[room][0].pages_releasable())


def test_a_failed_write_is_fenced_before_the_pages_go_back(ends: Any) -> None:
    prefill, failing, decode, fence = ends
    _open(prefill, decode, 1)
    prefill.call("send", 1, 3, True)   # a good room first: no fence for it
    wait_for(lambda: decode.call("poll", 1) == KVPoll.Success, TIMEOUT_S, "room 1")
    assert decode.call("check_bytes", 1) and fence.fence_calls == []

    fence.fence_result = False   # the transport cannot fence yet (connections still closing)
    failing.failing = True
    _open(prefill, decode, 2)
    prefill.call("send", 2, 3, True)
    wait_for(lambda: _ended(decode, 2), TIMEOUT_S, "room 2 to end at decode")
    assert decode.call("poll", 2) == KVPoll.Failed and "a WRITE to decode failed" in decode.call("failure", 2)
    wait_for(lambda: len(fence.fence_calls) >= 2, TIMEOUT_S, "the manager to try the fence (again)")
    assert set(fence.fence_calls) == {prefill.worker.manager.agent_name}
    assert not _releasable(decode, 2), "pages released before the writer's connections were fenced"
    fence.fence_result = True
    wait_for(lambda: _releasable(decode, 2), TIMEOUT_S, "room 2's pages after the fence")
    assert decode.call("metrics")["fenced_rooms_total"] == 1
    wait_for(lambda: prefill.call("reap") == prefill.start_free, TIMEOUT_S, "prefill's pages")
    wait_for(lambda: decode.call("reap") == decode.start_free, TIMEOUT_S, "decode's pages")


def test_rooms_ended_without_a_failed_write_are_not_fenced(ends: Any) -> None:
    prefill, _failing, decode, fence = ends
    fence.fence_result = False   # a fence would hold the pages: none may be asked for
    _open(prefill, decode, 1)
    prefill.call("abort", 1, "the prefill request was cancelled")   # before any write
    _open(prefill, decode, 2)
    prefill.call("send", 2, 1, False)   # one chunk landed; then decode's request is cancelled
    wait_for(lambda: decode.call("poll", 2) == KVPoll.Transferring, TIMEOUT_S, "room 2's first chunk")
    decode.worker.rooms[2][0].abort("client cancelled")
    for room in (1, 2):
        wait_for(lambda room=room: _ended(decode, room) and _releasable(decode, room), TIMEOUT_S,
                 f"room {room}'s pages")
    assert fence.fence_calls == []
    assert decode.call("metrics")["fenced_rooms_total"] == 0
    wait_for(lambda: decode.call("reap") == decode.start_free, TIMEOUT_S, "decode's pages")


def test_a_vanished_writer_is_fenced_before_the_pages_go_back(ends: Any) -> None:
    prefill, _failing, decode, fence = ends
    fence.fence_result = False
    _open(prefill, decode, 1)
    prefill.call("send", 1, 1, False)
    wait_for(lambda: decode.call("poll", 1) == KVPoll.Transferring, TIMEOUT_S, "room 1's first chunk")
    agent = prefill.worker.manager.agent_name
    prefill.call("crash")   # its process gone: what its kernel still holds could arrive
    wait_for(lambda: _ended(decode, 1), TIMEOUT_S, "room 1 to fail at decode")
    wait_for(lambda: fence.fence_calls != [], TIMEOUT_S, "the fence")
    assert set(fence.fence_calls) == {agent} and not _releasable(decode, 1)
    fence.fence_result = True
    wait_for(lambda: _releasable(decode, 1), TIMEOUT_S, "room 1's pages after the fence")


# --- the fence on plain sockets
# ------------------------------------------------------------------------------
class _Owner:
    """A listening socket and the thread that owns its accepted connections (as a transport's I/O thread
    does): reads until EOF or an error, then closes. ``stuck``: never closes (a broken transport)."""

    def __init__(self, stuck: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stuck = stuck
        self.received = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                break
            if not data:
                break
            self.received += len(data)
        if self.stuck:
            time.sleep(3600)
        conn.close()


def test_fence_host_closes_what_was_there_and_refuses_what_comes_after() -> None:
    owner = _Owner()
    old = socket.create_connection(("127.0.0.1", owner.port))
    old.sendall(b"x" * 1000)
    wait_for(lambda: owner.received == 1000, 5, "the first bytes")
    assert tcp_fence.fence_host({owner.port}, "localhost", 2.0)
    with pytest.raises(OSError):   # the fenced connection refuses later bytes (reset)
        for _ in range(50):
            old.sendall(b"y" * 65536)
            time.sleep(0.01)
    assert owner.received == 1000
    fresh = socket.create_connection(("127.0.0.1", owner.port))   # a connection after the fence is left alone
    fresh.sendall(b"z" * 10)
    wait_for(lambda: owner.received == 1010, 5, "the new connection's bytes")
    assert tcp_fence.fence_host({owner.port}, "10.255.255.1", 0.5)   # nothing from that host: at once
    assert tcp_fence.fence_host({owner.port}, "no-such-host.invalid", 0.5)
    old.close()
    fresh.close()


def test_fence_host_reports_connections_their_owner_does_not_close() -> None:
    owner = _Owner(stuck=True)
    conn = socket.create_connection(("127.0.0.1", owner.port))
    wait_for(lambda: len(tcp_fence._accepted_from({owner.port}, {"127.0.0.1"})) == 1, 5, "the connection")
    start_s = time.monotonic()
    assert not tcp_fence.fence_host({owner.port}, "127.0.0.1", 0.3)
    assert time.monotonic() - start_s < 2.0
    conn.close()


# --- Mooncake
# ------------------------------------------------------------------------------------------------
@pytest.mark.mooncake
def test_mooncake_fence_closes_the_writers_connections_and_later_rooms_arrive_whole() -> None:
    pytest.importorskip("mooncake.engine")
    prefill = RemoteSide("prefill", "prefill-mc-fence", "mooncake", **TIMEOUTS)
    decode = RemoteSide("decode", "decode-mc-fence", "mooncake", **TIMEOUTS)
    try:
        for side in (prefill, decode):
            side.start_free = side.call("start")
            side.rendezvous_url = side.call("rendezvous_url")
        for room in range(1, 5):
            decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 4 * PAGE_SIZE)
            prefill.call("open_sender", room, 4 * PAGE_SIZE)
            wait_for(lambda room=room: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S,
                     "the destination")
            prefill.call("send", room, 4, True)
            wait_for(lambda room=room: decode.call("poll", room) in (KVPoll.Success, KVPoll.Failed),
                     TIMEOUT_S, f"room {room}")
            assert decode.call("poll", room) == KVPoll.Success, decode.call("failure", room)
            assert decode.call("check_bytes", room)
            if room % 2 == 1:   # after rooms 1 and 3: the writer's pooled connections are cut
                before, fenced, after = decode.call("fence_writer", room)
                assert before >= 1 and fenced and after == 0, (before, fenced, after)
        wait_for(lambda: prefill.call("reap") == prefill.start_free, TIMEOUT_S, "prefill's pages")
        wait_for(lambda: decode.call("reap") == decode.start_free, TIMEOUT_S, "decode's pages")
    finally:
        for side in (prefill, decode):
            side.close()
