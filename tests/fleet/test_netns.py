"""The multi-host harness (``scripts/fleet/netns.py``): hosts reach each other and nothing else, a throttled
link runs near its rate, a link taken down refuses at once and works again when up, a partition cuts one pair
of hosts both ways and nothing else, and teardown leaves no
namespace, link or process behind, after an exception or after its owner was killed."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from fleet.netns import Fleet, cleanup, fleet_names

pytestmark = pytest.mark.netns
MakeFleet = Callable[[Sequence[str]], Fleet]

SINK = ("import socket, sys\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind((sys.argv[1], 5001)); s.listen()\n"
        "while True:\n"
        "    c, _ = s.accept()\n"
        "    while c.recv(1 << 20): pass\n"
        "    c.close()\n")
SOURCE = ("import socket, sys, time\n"
          "s = socket.create_connection((sys.argv[1], 5001), timeout=10); block = b'x' * (1 << 20)\n"
          "t0 = time.monotonic()\n"
          "for _ in range(int(sys.argv[2])): s.sendall(block)\n"
          "s.shutdown(socket.SHUT_WR); s.recv(1); print(int(sys.argv[2]) * (1 << 20) * 8 / (time.monotonic() "
          "- t0) / 1e6)\n")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); "
           "print('connected')\nexcept OSError as e:\n"
           "    print('errno', e.errno)\n")


def _names(fleet: Fleet) -> list[str]:
    spaces, links = fleet_names()
    return [n for n in spaces + links if n.startswith(fleet.base)]


def _rate_mbit(fleet: Fleet, src: str, dst: str, mib: int) -> float:
    out = fleet[src].run(["python", "-c", SOURCE, fleet[dst].address, str(mib)], timeout_s=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


def test_teardown_after_an_exception_leaves_nothing() -> None:
    fleet = Fleet(["a", "b"])
    with pytest.raises(RuntimeError, match="boom"), fleet:
        sleeper = fleet["a"].popen(["sleep", "600"])
        assert len(_names(fleet)) == 5   # 2 namespaces, bridge, 2 veths
        raise RuntimeError("boom")
    assert _names(fleet) == []
    assert sleeper.wait(5) is not None


def test_cleanup_removes_the_fleet_of_a_killed_owner(tmp_path: Path) -> None:
    """A process makes a fleet, starts a process in it, and dies by SIGKILL: the next cleanup removes it
    all."""
    script = ("import os, signal, sys; sys.path.insert(0, sys.argv[1])\n"
              "from fleet.netns import Fleet\n"
              "f = Fleet(['a']).create(); p = f['a'].popen(['sleep', '600'])\n"
              "print(f.base, p.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n")
    log = tmp_path / "owner.out"   # a file, not a pipe: the orphaned sleep would hold a pipe open
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parents[2] / "scripts")],
                              stdout=out, stderr=subprocess.STDOUT, timeout=60, check=False).returncode
    assert code == -signal.SIGKILL, log.read_text()
    base, pid = log.read_text().split()
    assert any(n.startswith(base) for n in sum(fleet_names(), []))
    removed = cleanup(stale_only=True)
    assert f"{base}-a" in removed
    assert not any(n.startswith(base) for n in sum(fleet_names(), []))
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_hosts_reach_each_other_and_nothing_else(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["a", "b"])
    routes = fleet["a"].run(["ip", "-4", "route"]).stdout.strip().splitlines()
    assert len(routes) == 1 and routes[0].startswith(f"{fleet['a'].address.rsplit('.', 1)[0]}.0/24 dev eth0")
    assert fleet["a"].run(["ip", "-4", "route", "show", "default"]).stdout.strip() == ""
    assert fleet["a"].run(["ip", "-6", "route"]).stdout.strip() == ""   # IPv6 off
    bridge_addrs = subprocess.run(["ip", "-o", "addr", "show", "dev", fleet.bridge], capture_output=True,
                                  text=True, check=True).stdout
    assert bridge_addrs.strip() == ""   # the machine's namespace has no address on the bridge
    assert fleet["a"].run(["ip", "link", "show", "lo"]).stdout.find("UP") > 0
    machine = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    for address in {line.split()[3].split("/")[0] for line in machine.splitlines()} - {"127.0.0.1"}:
        answer = fleet["a"].run(["python", "-c", CONNECT, address, "22"]).stdout.split()
        assert answer == ["errno", str(errno.ENETUNREACH)], (address, answer)
    fleet["b"].popen(["python", "-c", SINK, fleet["b"].address])
    time.sleep(1.0)
    assert _rate_mbit(fleet, "a", "b", 8) > 0


def test_throttled_link_runs_near_its_rate(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["a", "b"])
    fleet["b"].popen(["python", "-c", SINK, fleet["b"].address])
    time.sleep(1.0)
    fleet["a"].throttle(200)
    throttled = _rate_mbit(fleet, "a", "b", 24)
    assert 0.7 * 200 < throttled < 1.1 * 200, throttled
    fleet["a"].throttle(0)
    assert _rate_mbit(fleet, "a", "b", 48) > 1.5 * 200


def test_link_down_refuses_at_once_and_up_heals(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["a", "b"])
    fleet["b"].popen(["python", "-c", SINK, fleet["b"].address])
    time.sleep(1.0)
    before = fleet["a"].counters()
    fleet["a"].set_link(False)
    t0 = time.monotonic()
    answer = fleet["a"].run(["python", "-c", CONNECT, fleet["b"].address, "5001"]).stdout.split()
    assert answer == ["errno", str(errno.ENETUNREACH)] and time.monotonic() - t0 < 3
    fleet["a"].set_link(True)
    time.sleep(0.5)
    assert _rate_mbit(fleet, "a", "b", 4) > 0
    after = fleet["a"].counters()
    assert after.tx_bytes - before.tx_bytes >= 4 << 20
    assert os.path.exists(f"/sys/class/net/{fleet['a'].port}")


def test_a_partition_cuts_one_pair_of_hosts_and_heals(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["a", "b", "c"])
    for host in ("b", "c"):
        fleet[host].popen(["python", "-c", SINK, fleet[host].address])
    time.sleep(1.0)
    fleet.partition("a", "b", cut=True)
    # both ways, at once (a blackhole route: EINVAL, not a refusal)
    for src, dst in (("a", "b"), ("b", "a")):
        answer = fleet[src].run(["python", "-c", CONNECT, fleet[dst].address, "5001"]).stdout.split()
        assert answer == ["errno", str(errno.EINVAL)], (src, dst, answer)
    assert _rate_mbit(fleet, "a", "c", 4) > 0   # a's other paths stay up
    fleet.partition("a", "b", cut=False)
    fleet.partition("a", "b", cut=False)   # restoring twice is a no-op
    assert _rate_mbit(fleet, "a", "b", 4) > 0


def test_transport_settings_follow_the_host_address(make_fleet: MakeFleet) -> None:
    """Inside a host, its own address selects ``eth0`` for UCX (``kv_transfer.network``)."""
    fleet = make_fleet(["a"])
    code = ("import json, sys; from kv_transfer import network\n"
            "print(json.dumps(network.ucx_settings(sys.argv[1], network_only=True, rdma=False)))")
    out = fleet["a"].run(["python", "-c", code, fleet["a"].address])
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)
    assert settings["UCX_NET_DEVICES"] == "eth0" and settings["UCX_TLS"] == "tcp,self"
