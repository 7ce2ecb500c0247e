"""The command line of ``fleet.netns`` (``python scripts/fleet/netns.py <command>``; the module docstring
lists the commands): fleets tagged by name, made and removed by separate invocations."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from fleet.netns import (
    DEVICE,
    TRANSPORT_ENV_PREFIXES,
    Fleet,
    Host,
    cleanup,
    fleet_names,
    project_env,
    sh,
    teardown_names,
    unavailable_reason,
)


def existing_fleet(tag: str) -> Fleet:
    """The fleet ``tag`` as it exists on the machine (hosts in creation order)."""
    fleet = Fleet(["_"], tag)
    spaces, _ = fleet_names()
    for ns in spaces:
        if ns.startswith(fleet.base + "-"):
            name = ns[len(fleet.base) + 1:]
            peer_index = json.loads(sh("ip", "-n", ns, "-j", "link", "show", DEVICE).stdout)[0]["link_index"]
            bridge_port = next(p.name for p in Path("/sys/class/net").iterdir()
                               if (p / "ifindex").read_text().strip() == str(peer_index))
            addr = json.loads(sh("ip", "-n", ns, "-j", "-4", "addr", "show", DEVICE).stdout)[0]["addr_info"]
            fleet.hosts[name] = Host(name, ns, addr[0]["local"] if addr else "", bridge_port)
    return fleet


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="network namespaces as hosts (see the module docstring)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("create", "destroy", "exec", "throttle", "link", "counters", "cleanup", "show"):
        p = sub.add_parser(cmd)
        if cmd != "cleanup":
            p.add_argument("--tag", required=True)
        if cmd == "create":
            p.add_argument("--hosts", required=True, help="comma-separated host names")
        if cmd in ("exec", "throttle", "link", "counters"):
            p.add_argument("host")
        if cmd == "exec":
            p.add_argument("argv", nargs=argparse.REMAINDER)
        if cmd == "throttle":
            p.add_argument("rate_mbit", type=float)
        if cmd == "link":
            p.add_argument("state", choices=("up", "down"))
        if cmd == "cleanup":
            p.add_argument("--all", action="store_true", help="every pdn* fleet, not only orphaned ones")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    if args.cmd == "cleanup":
        print("\n".join(cleanup(stale_only=not args.all)))
        return 0
    if args.cmd == "create":
        fleet = Fleet(args.hosts.split(","), args.tag).create()
        print(json.dumps({h.name: {"netns": h.netns, "address": h.address} for h in fleet.hosts.values()}))
        return 0
    fleet = existing_fleet(args.tag)
    if args.cmd == "destroy":
        print("\n".join(teardown_names(fleet.base)))
        return 0
    if args.cmd == "show":
        print(json.dumps({h.name: {"netns": h.netns, "address": h.address, "port": h.port}
                          for h in fleet.hosts.values()}))
        return 0
    host = fleet[args.host]
    if args.cmd == "exec":
        argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        # the operator's own shell: its transport settings are meant for the command, so they go along
        mine = {k: v for k, v in os.environ.items() if k.startswith(TRANSPORT_ENV_PREFIXES)}
        return subprocess.call(["ip", "netns", "exec", host.netns, *argv_], env=project_env(mine))
    if args.cmd == "throttle":
        host.throttle(args.rate_mbit)
    elif args.cmd == "link":
        host.set_link(args.state == "up")
    print(json.dumps(vars(host.counters())))
    return 0


