"""``scripts/fleet/serve_hosts.py`` when a server cannot start: ``HostFleet.start`` raises with the failing
server's log, and ``stop`` leaves no namespace, link or process of the fleet behind (the live tests' teardown
path when a test fails before or after the fleet came up); and a host's server gets none of this process's
transport variables. No tritonserver starts: every serve.sh exits at its argument check, or none is
started."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleet.netns import fleet_names, unavailable_reason
from fleet.serve_hosts import HostFleet

pytestmark = pytest.mark.netns


def test_a_fleet_whose_servers_fail_raises_with_the_log_and_leaves_nothing(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    fleet = HostFleet(tmp_path, env={"ROLE": "nonsense"})
    try:
        with pytest.raises(RuntimeError, match="ROLE must be all, router, prefill, decode"):
            fleet.start(60.0)
        netns = fleet.host("reg").netns
    finally:
        fleet.stop()
    spaces, links = fleet_names()
    assert not [n for n in spaces + links if n.startswith(fleet.fleet.base)], (spaces, links)
    assert netns not in spaces
    fleet.stop()   # idempotent


def test_a_hosts_server_gets_none_of_this_process_transport_settings(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A test's in-process NIXL agent leaves ``UCX_NET_DEVICES=lo`` in this process's environment; a host's
    server that inherited it could not reach another host (every room failed: "UCX cannot load the peer's
    address", seen when tests/kv_transfer ran before tests/fleet in one process). Settings the run gives the
    fleet itself still reach every server."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "1")
    fleet = HostFleet(tmp_path, env={"UCX_TLS": "tcp,self"})
    try:
        fleet.fleet.create()
        env = fleet.serve_script("pf", tmp_path / "fleet-secret")._env
        address = fleet.host("pf").address
    finally:
        fleet.stop()
    assert "UCX_NET_DEVICES" not in env and "MC_TCP_LANES_PER_PEER" not in env
    assert env["UCX_TLS"] == "tcp,self" and env["ADVERTISE_HOST"] == address and env["ROLE"] == "prefill"
