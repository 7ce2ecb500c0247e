"""First contact with a NIXL peer must never wait for that peer.

``NixlTransport.add_peer`` (``add_remote_agent`` + ``prep_xfer_dlist`` + the warm-up ``send_notif``) runs on
the manager thread, with the agent created on another thread (``start()`` runs on Triton's ``initialize``
thread).
A peer whose manager thread does not progress UCX (busy, or not yet ticking) must not block it: here the peer
process registers its memory and then never calls NIXL again, and ``add_peer`` still returns at once. Only
the first WRITE with a notification waits for the peer to progress (UCX over TCP, docs/protocol.md), and it
finishes once the peer drains its notifications.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import threading
import time
from typing import Any

import numpy as np
import pytest
from kv_harness import host_side

from kv_transfer.blocks import BlockTable

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]

AUX_SLOTS = 4
NUM_PAGES = 4
ADD_PEER_LIMIT_S = 2.0   # measured ~3-15 ms on 2 busy cores; a peer-dependent wait would be the whole hold


def _silent_peer(conn: Any) -> None:
    """Registers, hands out its metadata, then makes no NIXL call until told to drain notifications."""
    from kv_transfer.nixl_transport import NixlTransport

    pool, aux, table = host_side(NUM_PAGES, 0.0, AUX_SLOTS)
    transport = NixlTransport("silent-peer")
    transport.register(table)
    conn.send((transport.metadata(), pool.ctypes.data, aux.ctypes.data))
    conn.recv()                       # held here, not progressing, while the other side adds us
    deadline = time.monotonic() + 10.0
    got: list[bytes] = []
    while time.monotonic() < deadline and b"first" not in got:
        got += [m for _, m in transport.get_notifs()]
        time.sleep(0.005)
    conn.send(got)
    conn.recv()
    transport.close()


def test_add_peer_does_not_wait_for_a_silent_peer() -> None:
    from kv_transfer.nixl_transport import NixlTransport

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_silent_peer, args=(there,), daemon=True)
    peer.start()
    transport = NixlTransport("initiator")
    try:
        _pool, _aux, table = host_side(NUM_PAGES, 0.0, AUX_SLOTS)   # _pool, _aux: registered, kept alive
        transport.register(table)     # this (the "initialize") thread creates the agent
        assert here.poll(60), "peer process did not start"
        metadata, kv_ptr, aux_ptr = here.recv()
        peer_table = BlockTable(kv_ptr, table.layout, aux_ptr, AUX_SLOTS)
        result: dict[str, Any] = {}

        def manager_thread() -> None:   # every later call on another thread, as in KVManager
            start_s = time.monotonic()
            result["name"] = transport.add_peer(metadata, peer_table)
            result["add_peer_s"] = time.monotonic() - start_s
            result["handle"] = transport.post_write(result["name"], np.array([0]), np.array([0]), b"first")

        thread = threading.Thread(target=manager_thread)
        thread.start()
        thread.join(ADD_PEER_LIMIT_S + 5.0)
        assert not thread.is_alive(), "add_peer/post_write blocked while the peer made no NIXL call"
        assert result["add_peer_s"] < ADD_PEER_LIMIT_S
        here.send("drain")            # the peer progresses now: the first WRITE completes
        deadline = time.monotonic() + 10.0
        while transport.check(result["handle"]).name == "PROC" and time.monotonic() < deadline:
            time.sleep(0.002)
        assert transport.check(result["handle"]).name == "DONE"
        transport.release(result["handle"])
        assert here.poll(15)
        assert b"first" in here.recv()
        here.send("stop")
    finally:
        transport.close()
        peer.join(10)
        if peer.is_alive():
            peer.kill()
