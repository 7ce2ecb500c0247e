"""``scripts/fleet/serve_hosts.py`` when a server cannot start: ``HostFleet.start`` raises with the failing server's
log, and ``stop`` leaves no namespace, link or process of the fleet behind (the live tests' teardown path when a
test fails before or after the fleet came up). No tritonserver starts: every serve.sh exits at its argument check."""

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
