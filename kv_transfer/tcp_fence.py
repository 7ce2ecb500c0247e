"""Closing this process's accepted TCP connections from one host, so that no late byte from it lands here.

Why (docs/multihost.md "Late writes after a partition"): a transport that writes into our memory over TCP
(Mooncake's) may give a write up while part of it still sits in a kernel on the way (a partition); when the
link returns, the connection delivers it, and our side of the transport copies it to the addresses of the
failed write, into pages that may by then belong to another request. Only the receiving side can stop that:
``fence_host`` shuts down (``SHUT_RDWR``) every connection this process accepted on ``local_ports`` from
``host`` and waits until the transport's own I/O thread has closed them. After a shutdown the kernel refuses
what arrives (the sender gets a reset); what it had queued before is still read by the transport's thread, so
the fence holds only once the connection is gone from this process, which is what ``fence_host`` waits for.

The sockets are the transport's: they are shut down through a duplicate of their descriptor (checked to still
name the same connection), never closed here. Linux only (``/proc`` through ``psutil``). Cost: one scan of the
network namespace's TCP table per try (~10 ms on the dev VM), only on the failure paths that call it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Collection

import psutil

logger = logging.getLogger(__name__)

#: How often ``fence_host`` looks again while it waits for the connections to close, seconds.
POLL_S = 0.01


def listening_ports() -> set[int]:
    """TCP ports this process listens on (any address)."""
    return {c.laddr.port for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr}


def host_addresses(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address) resolves to, IPv4-mapped IPv6 unwrapped; empty when it
    does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {_plain(str(info[4][0])) for info in infos}


def _plain(ip: str) -> str:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


Address = tuple[str, int]   # (ip, port)


def _accepted_from(local_ports: Collection[int], remotes: set[str]) -> list[tuple[int, Address, Address]]:
    """(descriptor, local, remote) of each connection on ``local_ports`` from one of ``remotes``."""
    found = []
    for conn in psutil.Process().net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN or not conn.raddr or not conn.laddr or conn.fd < 0 \
                or conn.laddr.port not in local_ports:
            continue
        remote = (_plain(conn.raddr.ip), conn.raddr.port)
        if remote[0] in remotes:
            found.append((conn.fd, (_plain(conn.laddr.ip), conn.laddr.port), remote))
    return found


def _shutdown(fd: int, local: Address, remote: Address) -> None:
    try:
        dup = os.dup(fd)
    except OSError:
        return   # closed meanwhile
    sock = socket.socket(fileno=dup)
    try:
        # the descriptor may have been closed and reused since the scan: only the same connection is shut
        here, there = sock.getsockname(), sock.getpeername()
        if (_plain(here[0]), here[1]) == local and (_plain(there[0]), there[1]) == remote:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass   # already shut down or reset
    finally:
        sock.close()   # the duplicate only; the transport's descriptor stays its own


def fence_host(local_ports: Collection[int], host: str, timeout_s: float = 2.0) -> bool:
    """Shuts down every connection accepted on ``local_ports`` from ``host`` when called and waits up to
    ``timeout_s`` seconds for the owner to close them. True when none of them is left (none there at all
    included); False when some are still open at the deadline (call again: a new call shuts down what is there
    then). Connections accepted after the call are left alone: what they carry was written after it. Any
    thread; never raises for a connection that goes away meanwhile. ``host`` that does not resolve: True (no
    connection can come from it)."""
    remotes = host_addresses(host)
    if not remotes or not local_ports:
        return True
    first = _accepted_from(local_ports, remotes)
    if not first:
        return True
    for fd, local, remote in first:
        _shutdown(fd, local, remote)
    targets = {(local, remote) for _fd, local, remote in first}
    deadline_s = time.monotonic() + timeout_s
    while True:
        left = targets & {(local, remote) for _fd, local, remote in _accepted_from(local_ports, remotes)}
        if not left:
            logger.info("fenced %d connection(s) from %s on ports %s", len(targets), host,
                        sorted(local_ports))
            return True
        if time.monotonic() >= deadline_s:
            logger.warning("%d connection(s) from %s still open %.1f s after their shutdown", len(left), host,
                           timeout_s)
            return False
        time.sleep(POLL_S)
