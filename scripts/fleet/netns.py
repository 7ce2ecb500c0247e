"""Network "hosts" on one machine: a Linux network namespace per host, joined by veth pairs on a private
bridge.

Each host has its own network stack: loopback (up), one link ``eth0`` with an address of a private /24 that no
interface of the machine uses, and exactly one route (that /24, on ``eth0``). The bridge in the machine's own
namespace has no address, IPv6 is off on every link the fleet makes, and nothing forwards or NATs: a packet
from a host reaches the other hosts and nothing else. Processes started with ``Host.popen`` run inside the
host's namespace with the project's environment (the venv's ``bin`` first on ``PATH``, the repository on
``PYTHONPATH``).

Names: a fleet owns every name starting with ``pdn<tag>`` (namespaces ``pdn<tag>-<host>``, bridge
``pdn<tag>br``, veths ``pdn<tag>v<i>``). A fleet made from Python is tagged with its process id (hex) and a
letter g-z (up to 20 fleets alive per process), so ``cleanup()`` (run by every new fleet) removes the fleets
whose process died, even by SIGKILL; ``teardown`` removes the fleet's own names and
kills every process in its namespaces (``ip netns pids``). Teardown is idempotent and never raises.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable_reason()`` says why a machine cannot.

CLI (fleets tagged by name live until ``destroy``)::

    python scripts/fleet/netns.py create --tag demo --hosts router,prefill,decode
    python scripts/fleet/netns.py exec --tag demo prefill -- python -c 'print(1)'
    python scripts/fleet/netns.py throttle --tag demo prefill 1000      # Mbit/s; 0 removes the limit
    python scripts/fleet/netns.py link --tag demo prefill down          # or up
    python scripts/fleet/netns.py counters --tag demo prefill
    python scripts/fleet/netns.py destroy --tag demo                    # `cleanup --all`: every pdn* fleet
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

PREFIX = "pdn"
DEVICE = "eth0"                      # the host's link, inside its namespace
ROOT = Path(__file__).resolve().parents[2]
SUBNET_CANDIDATES = tuple(
    ipaddress.IPv4Network(f"10.{a}.{b}.0/24") for a in (213, 217, 231) for b in range(8))
STOP_GRACE_S = 5.0
_TAG_RE = re.compile(r"^[a-z0-9]{1,7}$")
_OWNED_TAG_RE = re.compile(r"^([0-9a-f]+)[g-z]$")   # <owner pid in hex><fleet letter>
_SERIALS = "ghijklmnopqrstuvwxyz"
_serial = itertools.count()


@dataclass(frozen=True)
class LinkCounters:
    """Bytes and packets a host's link carried since it was made (as the host sees them)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int


def sh(*argv: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Runs one command (no shell); raises ``subprocess.CalledProcessError`` with its stderr when
    ``check``."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc


def unavailable_reason() -> str | None:
    """None when this process can make network namespaces, else why not (not root, no ``ip``/``tc``)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid is {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


#: Transport settings a host of the fleet does not inherit from this process: they describe this process's
#: own network (an in-process NIXL agent of a test puts ``UCX_NET_DEVICES=lo`` here for loopback), not a
#: host's. A run that wants them on the hosts passes them in ``extra``.
TRANSPORT_ENV_PREFIXES = ("UCX_", "MC_")


def project_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its transport settings (``TRANSPORT_ENV_PREFIXES``), with the
    project's venv first on ``PATH`` and the repository on ``PYTHONPATH`` (what ``scripts/serve.sh`` gives its
    children), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(TRANSPORT_ENV_PREFIXES)}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONPATH"] = str(ROOT) + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def pick_subnet(candidates: Sequence[ipaddress.IPv4Network] = SUBNET_CANDIDATES) -> ipaddress.IPv4Network:
    """The first candidate /24 that overlaps no address or route of the machine's namespace. Raises
    ``RuntimeError`` when all are taken."""
    used = []
    for line in sh("ip", "-4", "-o",
                   "addr").stdout.splitlines() + sh("ip", "-4", "route").stdout.splitlines():
        for word in line.split():
            try:
                used.append(ipaddress.IPv4Network(word, strict=False))
            except ValueError:
                continue
    for net in candidates:
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("every candidate subnet overlaps an address or route of this machine")


def _write_sysctl(path: str, value: str) -> None:
    try:
        Path(path).write_text(value)
    except OSError:
        pass   # no IPv6 in this kernel: nothing to turn off


@dataclass
class Host:
    """One namespace of a fleet. ``address`` is its IPv4 address on ``eth0``; ``port`` the bridge-side
    veth."""

    name: str
    netns: str
    address: str
    port: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[bytes]:
        """Starts ``argv`` inside this host (``ip netns exec``) in a new session, with ``project_env(env)``;
        the fleet's teardown kills it. ``kwargs`` go to ``subprocess.Popen`` (stdout, stderr, cwd, ...)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], env=project_env(env),
                                start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` inside this host to completion; returns its output (no check)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], env=project_env(env),
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def set_link(self, up: bool) -> None:
        """Takes the host's link down (a partition: new connections fail at once, open ones stall) or up."""
        sh("ip", "-n", self.netns, "link", "set", DEVICE, "up" if up else "down")

    def throttle(self, rate_mbit: float) -> None:
        """Limits the link to ``rate_mbit`` Mbit/s in both directions (``tc tbf`` on both ends of the veth);
        0 removes the limit. Burst: one 4 ms tick of the rate, at least 128 KiB (a GSO packet must fit)."""
        ends = (("ip", "netns", "exec", self.netns, "tc"), DEVICE), (("tc",), self.port)
        for prefix, dev in ends:
            sh(*prefix, "qdisc", "del", "dev", dev, "root", check=False)
            if rate_mbit > 0:
                burst = max(int(rate_mbit * 1e6 / 8 * 0.004), 128 * 1024)
                sh(*prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                   "burst", str(burst), "latency", "100ms")

    def counters(self) -> LinkCounters:
        """The link's counters, read at the bridge end (its rx is the host's tx) without entering the
        namespace."""
        stats = Path("/sys/class/net") / self.port / "statistics"
        read = {n: int((stats / n).read_text()) for n in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")}
        return LinkCounters(tx_bytes=read["rx_bytes"], rx_bytes=read["tx_bytes"],
                            tx_packets=read["rx_packets"], rx_packets=read["tx_packets"])


class Fleet:
    """``hosts`` namespaces on one bridge; ``create`` makes them, ``teardown`` removes them (a ``with`` block
    does both). ``tag``: 1-7 of [a-z0-9]; default this process's id and a serial letter (so a later fleet
    cleans it up if this process dies without tearing down). Not thread-safe: one owner thread."""

    def __init__(self, hosts: Sequence[str], tag: str | None = None,
                 subnet: ipaddress.IPv4Network | None = None, mtu: int = 1500) -> None:
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise ValueError(f"hosts must be 1-250 distinct names, got {list(hosts)}")
        self.tag = tag if tag is not None else f"{os.getpid():x}{_SERIALS[next(_serial) % len(_SERIALS)]}"
        if not _TAG_RE.match(self.tag):
            raise ValueError(f"tag must be 1-7 of [a-z0-9], got {self.tag!r}")
        self.base = f"{PREFIX}{self.tag}"
        self.bridge = f"{self.base}br"
        self._names, self._subnet, self._mtu = list(hosts), subnet, mtu
        self.hosts: dict[str, Host] = {}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def create(self) -> Fleet:
        """Makes the bridge, then per host a namespace, a veth pair and an address. Raises
        ``subprocess.CalledProcessError`` (after removing what it made) when a step fails."""
        cleanup(stale_only=True)
        teardown_names(self.base)   # a fleet of the same tag left behind
        subnet = self._subnet or pick_subnet()
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            _write_sysctl(f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6", "1")
            sh("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(self._names):
                self.hosts[name] = self._add_host(i, name, str(subnet.network_address + 1 + i),
                                                  subnet.prefixlen)
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_host(self, i: int, name: str, address: str, prefixlen: int) -> Host:
        host = Host(name, f"{self.base}-{name}", address, f"{self.base}v{i}")
        sh("ip", "netns", "add", host.netns)
        sh("ip", "link", "add", host.port, "mtu", str(self._mtu), "type", "veth", "peer", "name", DEVICE,
           "mtu", str(self._mtu), "netns", host.netns)
        _write_sysctl(f"/proc/sys/net/ipv6/conf/{host.port}/disable_ipv6", "1")
        sh("ip", "link", "set", host.port, "master", self.bridge, "up")
        sh("ip", "netns", "exec", host.netns, "sh", "-c",
           f"echo 1 > /proc/sys/net/ipv6/conf/{DEVICE}/disable_ipv6 || true")
        sh("ip", "-n", host.netns, "addr", "add", f"{address}/{prefixlen}", "dev", DEVICE)
        sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        sh("ip", "-n", host.netns, "link", "set", DEVICE, "up")
        return host

    def partition(self, a: str, b: str, cut: bool) -> None:
        """Cuts (``cut``) or restores the path between hosts ``a`` and ``b`` alone, both ways: a blackhole
        route to the other's address in each (new connections between them fail at once, open ones stall and
        retransmit, as on a link down); both keep their links to every other host. Routes, not filters: this
        kernel has neither ``tc`` prio/gact nor iptables. Restoring a path that is not cut is a no-op."""
        for here, there in ((self.hosts[a], self.hosts[b]), (self.hosts[b], self.hosts[a])):
            sh("ip", "-n", here.netns, "route", "add" if cut else "del", "blackhole", f"{there.address}/32",
               check=cut)

    @contextlib.contextmanager
    def partitioned(self, a: str, b: str, at_least_s: float = 0.0) -> Iterator[float]:
        """The path between ``a`` and ``b`` cut (``partition``) for the ``with`` body and for at least
        ``at_least_s`` seconds after the cut, then restored, however the body ends; yields the cut's
        ``time.monotonic()``."""
        self.partition(a, b, cut=True)
        cut_s = time.monotonic()
        try:
            yield cut_s
        finally:
            time.sleep(max(0.0, at_least_s - (time.monotonic() - cut_s)))
            self.partition(a, b, cut=False)

    def teardown(self) -> None:
        """Stops the processes started through ``Host.popen`` (TERM to their process groups, KILL after
        ``STOP_GRACE_S``), then removes every name of this fleet. Idempotent; never raises."""
        procs = [p for h in self.hosts.values() for p in h.procs if p.poll() is None]
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline_s = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.01, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(5)
        teardown_names(self.base)
        self.hosts.clear()

    def __enter__(self) -> Fleet:
        return self.create()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.teardown()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def fleet_names() -> tuple[list[str], list[str]]:
    """(namespaces, links) of the machine whose names start with ``PREFIX``."""
    spaces = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line]
    links = [p.name for p in Path("/sys/class/net").iterdir()]
    return [s for s in spaces if s.startswith(PREFIX)], [n for n in links if n.startswith(PREFIX)]


def teardown_names(base: str) -> list[str]:
    """Kills every process in the namespaces named ``<base>-*``, deletes them and the links ``<base>*``;
    returns what it removed. Never raises."""
    spaces, links = fleet_names()
    removed = []
    for ns in (s for s in spaces if s.startswith(base + "-")):
        for _ in range(3):   # a process may fork while we kill
            pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        sh("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    for link in (n for n in links if n.startswith(base) and n[len(base):] in ("br",) + tuple(
            f"v{i}" for i in range(256))):
        sh("ip", "link", "del", link, check=False)
        removed.append(link)
    return removed


def cleanup(stale_only: bool = False) -> list[str]:
    """Removes every fleet (``stale_only``: only those made from Python by a process that no longer exists);
    returns the names removed. Never raises."""
    spaces, links = fleet_names()
    tags = {re.match(rf"{PREFIX}([a-z0-9]+?)(?:-.*|br|v\d+)$", n) for n in spaces + links}
    removed = []
    for tag in sorted({m.group(1) for m in tags if m}):
        owner = _OWNED_TAG_RE.match(tag)
        if stale_only and (owner is None or Path(f"/proc/{int(owner.group(1), 16)}").exists()):
            continue
        removed += teardown_names(f"{PREFIX}{tag}")
    return removed


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fleet.cli import main
    sys.exit(main())
