"""The decode side's manager thread keeps the transport progressed while rooms wait for KV, where bytes land only
as the transport is polled (NIXL over UCX's TCP transport: ``Transport.receives_by_polling``).

Found across network hosts (docs/multihost.md, "The decode side's pace"): with inline progress the manager thread
waited 5 ms between rounds while rooms were open, leaving progress to the engine loop's polls, and a 4k-token
room's KV (180 MiB) moved in 170 ms with the caller polling every 20 ms (a decode engine stepping other requests)
against 95 ms with the thread draining every ``active_tick_s``. Where the peer or the transport's own threads move
the bytes (cma on one host, Mooncake, in-process) the thread keeps its slower pace (no CPU spent for nothing).
"""

from __future__ import annotations

import pytest
from kv_harness import LocalSide, SideWorker, wait_for

from kv_transfer import KVManager, KVPoll
from kv_transfer.decode_side import INLINE_ACTIVE_TICK_S
from kv_transfer.inprocess import InProcessTransport

TIMEOUT_S = 10.0
ACTIVE_TICK_S = 0.0003


class PolledInProcess(InProcessTransport):
    """The in-process transport declaring that its peers' writes land only while it is polled."""

    @property
    def receives_by_polling(self) -> bool:
        return True


def _decode(name: str, polled: bool) -> LocalSide:
    decode = LocalSide("decode", f"decode-{name}", "inprocess", active_tick_s=ACTIVE_TICK_S)
    if polled:
        worker: SideWorker = decode.worker
        worker.manager.shutdown()   # never started: swap in the transport
        worker.manager = KVManager(worker.args, PolledInProcess(worker.args.instance_id))
    decode.start_free = decode.call("start")
    decode.rendezvous_url = decode.call("rendezvous_url")
    return decode


@pytest.mark.parametrize(("polled", "pace_s"), [(True, ACTIVE_TICK_S), (False, INLINE_ACTIVE_TICK_S)])
def test_rooms_waiting_for_kv_are_progressed_at_the_transports_need(polled: bool, pace_s: float) -> None:
    prefill = LocalSide("prefill", f"prefill-pace-{polled}", "inprocess")
    prefill.start_free = prefill.call("start")
    prefill.rendezvous_url = prefill.call("rendezvous_url")
    decode = _decode(f"pace-{polled}", polled)
    try:
        manager = decode.worker.manager
        assert manager._transport.receives_by_polling is polled
        assert manager._side._wait_s != pace_s            # idle: the idle tick
        room = 8101
        decode.call("open_receiver", room, prefill.instance_id, prefill.rendezvous_url, 64)
        prefill.call("open_sender", room, 64)
        wait_for(lambda: prefill.call("poll", room) >= KVPoll.WaitingForInput, TIMEOUT_S, "destination at prefill")
        # the room is published and waits for its KV (the prefill computing): the thread's pace while it waits
        wait_for(lambda: manager._side._wait_s == pace_s, TIMEOUT_S, f"the decode thread waiting {pace_s} s")
        prefill.call("send", room, 4, True)
        wait_for(lambda: decode.call("poll", room) == KVPoll.Success, TIMEOUT_S, "Success at decode")
        for side in (decode, prefill):
            wait_for(lambda: side.call("reap") == side.start_free, TIMEOUT_S, f"{side.instance_id}'s pages back")
    finally:
        for side in (decode, prefill):
            side.call("stop")


@pytest.mark.parametrize(("hostname", "network_only", "polled"), [
    ("127.0.0.1", False, False),     # one host: cma / shared memory, the writer copies
    ("127.0.0.1", True, True),       # UCX kept to TCP
    ("10.1.2.3", False, True),       # an address peers on other hosts reach: TCP (or RDMA) to them
])
def test_nixl_receives_by_polling_where_peers_may_come_over_the_network(hostname: str, network_only: bool,
                                                                          polled: bool) -> None:
    from kv_transfer.nixl_transport import NixlTransport

    transport = NixlTransport.__new__(NixlTransport)     # the rule only: no agent, no UCX settings applied
    transport._hostname, transport._network_only = hostname, network_only
    assert transport.receives_by_polling is polled
