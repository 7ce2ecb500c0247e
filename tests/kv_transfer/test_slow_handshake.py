"""A slow first handshake with one peer holds up nothing else of the instance.

Across hosts a first handshake (the peer's registration over HTTP, then the agent's ``add_peer``) can take
seconds: one full-suite run saw ~5 s between two network-namespace hosts, and the decode instance then looked
dead to its router (no load report: the heartbeat ran on the manager thread) and stalled every stream (its
engine loop drained notifications through the agent that the handshake held), so the router gave its requests
up and opened its breaker. Here one side's ``add_peer`` for a new peer takes ``SLOW_S`` (a transport that
delays it: the network's slowness, not the product's code) while the instance also serves a room with a peer
it knows. During the handshake:

- its load reports keep coming (the ``age_s`` routers read from its rendezvous stays under a second);
- the engine-thread calls (``KVReceiver.poll`` on decode, ``KVSender.send`` of a last chunk on prefill) return
  at once instead of waiting the handshake out;
- after it, every room completes with the right bytes and every page comes back.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kv_harness import PAGE_SIZE, LocalSide, SideWorker, wait_for

from bootstrap.client import BootstrapClient
from kv_transfer import KVManager, KVPoll
from kv_transfer.blocks import BlockTable
from kv_transfer.inprocess import InProcessTransport

SLOW_S = 3.0
TIMEOUT_S = 15.0
CALL_BOUND_S = 0.5   # an engine-thread call during the handshake: at once, not SLOW_S
# heartbeat_interval_s is 0.2 s here; routers give an instance up after 3 s (instance_stale_s)
AGE_BOUND_S = 1.0
TIMEOUTS = {"bootstrap_timeout_s": 20.0, "waiting_timeout_s": 20.0}


class SlowFirstContact(InProcessTransport):
    """The in-process transport whose ``add_peer`` first sleeps ``delay_s`` (0 until a test sets it)."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id)
        self.delay_s = 0.0
        self.in_add_peer = threading.Event()

    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        self.in_add_peer.set()
        try:
            time.sleep(self.delay_s)
            return super().add_peer(metadata, table)
        finally:
            self.in_add_peer.clear()


def _side(role: str, name: str) -> tuple[LocalSide, SlowFirstContact]:
    side = LocalSide(role, name, "inprocess", **TIMEOUTS)
    worker: SideWorker = side.worker
    worker.manager.shutdown()   # never started: swap in the delaying transport
    slow = SlowFirstContact(worker.args.instance_id)
    worker.manager = KVManager(worker.args, slow)
    side.start_free = side.call("start")
    side.rendezvous_url = side.call("rendezvous_url")
    return side, slow


def _trio(role: str) -> tuple[LocalSide, SlowFirstContact, LocalSide, LocalSide]:
    """A ``role`` side whose handshakes the test can slow down, and two sides of the other role (the test lets
    it meet the first one quickly, then the second one slowly)."""
    other = "decode" if role == "prefill" else "prefill"
    side, slow = _side(role, f"{role}-slowhs")
    return side, slow, _side(other, f"{other}-1-slowhs")[0], _side(other, f"{other}-2-slowhs")[0]


def _open(prefill: LocalSide, decode: LocalSide, room: int, num_tokens: int) -> None:
    decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, num_tokens)
    prefill.call("open_sender", room, num_tokens)


def _finish(prefill: LocalSide, decode: LocalSide, room: int) -> None:
    wait_for(lambda: decode.call("poll", room) == KVPoll.Success, TIMEOUT_S, f"room {room} Success at decode")
    wait_for(lambda: prefill.call("poll", room) == KVPoll.Success, TIMEOUT_S,
             f"room {room} Success at prefill")
    assert decode.call("check_bytes", room)


def _first_contact(prefill: LocalSide, decode: LocalSide) -> None:
    """Room 1 between the two, fast: each side knows the other afterwards."""
    _open(prefill, decode, 1, 3 * PAGE_SIZE)
    prefill.call("send", 1, 3, True)
    _finish(prefill, decode, 1)


def _age_s(side: LocalSide, role: str) -> float:
    client = BootstrapClient(side.rendezvous_url)
    try:
        (status,) = [s for s in client.list_instances(role) if s.instance_id == side.instance_id]
        return status.age_s
    finally:
        client.close()


def _during(slow: SlowFirstContact, probe: Any) -> list[Any]:
    """Calls ``probe()`` every 50 ms while ``slow.add_peer`` sleeps; the probes' results."""
    wait_for(slow.in_add_peer.is_set, TIMEOUT_S, "the slow handshake to begin")
    results = []
    while slow.in_add_peer.is_set():
        results.append(probe())
        time.sleep(0.05)
    return results


def _timed(call: Any) -> float:
    start_s = time.monotonic()
    call()
    return time.monotonic() - start_s


def test_decode_keeps_reporting_and_polling_while_it_handshakes_with_a_new_prefill() -> None:
    decode, slow, p1, p2 = _trio("decode")
    try:
        _first_contact(p1, decode)
        _open(p1, decode, 2, 2 * PAGE_SIZE)   # a room with the known peer, waiting for its KV
        wait_for(lambda: p1.call("poll", 2) >= KVPoll.WaitingForInput, TIMEOUT_S,
                 "room 2's destination at p1")
        slow.delay_s = SLOW_S
        _open(p2, decode, 3, 2 * PAGE_SIZE)   # first contact with p2: SLOW_S
        probes = _during(slow, lambda: (_timed(lambda: decode.call("poll", 2)), _age_s(decode, "decode")))
        assert len(probes) >= 10, probes
        assert max(t for t, _ in probes) < CALL_BOUND_S, probes
        assert max(age for _, age in probes) < AGE_BOUND_S, probes
        p1.call("send", 2, 2, True)
        p2.call("send", 3, 2, True)
        _finish(p1, decode, 2)
        _finish(p2, decode, 3)
        for side in (p1, p2, decode):
            wait_for(lambda side=side: side.call("reap") == side.start_free, TIMEOUT_S, "pages back")
    finally:
        for side in (decode, p1, p2):
            side.call("stop")


def test_prefill_keeps_reporting_and_sending_while_it_handshakes_with_a_new_decode() -> None:
    prefill, slow, d1, d2 = _trio("prefill")
    try:
        _first_contact(prefill, d1)
        waiting = list(range(10, 40))   # rooms with the known decode, destinations in, KV not sent yet
        for room in waiting:
            _open(prefill, d1, room, PAGE_SIZE)
        for room in waiting:
            wait_for(lambda room=room: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S,
                     f"room {room}'s destination at prefill")
        slow.delay_s = SLOW_S
        _open(prefill, d2, 2, 2 * PAGE_SIZE)   # d2's destination reaches prefill: first contact, SLOW_S
        unsent = list(waiting)

        def probe() -> tuple[float, float]:
            # the last chunk's send posts inline (no thread hop): it must not wait for the handshake
            took_s = _timed(lambda: prefill.call("send", unsent.pop(), 1, True)) if unsent else 0.0
            return took_s, _age_s(prefill, "prefill")

        probes = _during(slow, probe)
        assert len(probes) >= 10, probes
        assert len(unsent) < len(waiting), "no room was sent during the handshake"
        assert max(t for t, _ in probes) < CALL_BOUND_S, probes
        assert max(age for _, age in probes) < AGE_BOUND_S, probes
        for room in unsent:
            prefill.call("send", room, 1, True)
        prefill.call("send", 2, 2, True)
        _finish(prefill, d2, 2)
        for room in waiting:
            _finish(prefill, d1, room)
        for side in (prefill, d1, d2):
            wait_for(lambda side=side: side.call("reap") == side.start_free, TIMEOUT_S, "pages back")
    finally:
        for side in (d1, d2, prefill):
            side.call("stop")
