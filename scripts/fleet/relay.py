"""Reach a port inside a network host of the harness from this process: a TCP relay from a loopback port of
the machine's own namespace to an address and port as seen from inside one host.

The hosts of ``scripts/fleet/netns.py`` are unreachable from the machine's namespace by design (the bridge has
no address, nothing forwards). A test that wants to speak gRPC or HTTP to a server inside a host (a client
library opening its own sockets) connects to the relay's loopback port instead; for each connection the relay
opens a socket inside the host's namespace (``setns`` on the relaying thread, only for the ``socket()`` call:
a socket belongs to the namespace it was made in) and copies bytes both ways until either side closes.
Targeting the host's own address from inside that host goes over the host's loopback, so a relay keeps working
while the host's link is down (metrics of a partitioned host stay readable) and adds no traffic to the link.

Linux only; needs root (``setns``) and a namespace made by ``ip netns`` (``/var/run/netns/<name>``).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from types import TracebackType

CLONE_NEWNET = 0x40000000
CONNECT_TIMEOUT_S = 5.0
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def netns_socket(netns: str) -> socket.socket:
    """A TCP/IPv4 socket of namespace ``netns`` (``ip netns`` name), made by this thread while it is in that
    namespace; the thread is back in its own namespace on return. Raises OSError (no such namespace, no
    root)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


class Relay:
    """Listens on ``127.0.0.1:<port>`` (a free port, ``self.port``) and relays every connection to
    ``address:target_port`` dialled from inside ``netns``. ``start`` binds and starts the accepting thread;
    ``close`` stops accepting (relayed connections end when either side closes). Threads: one acceptor, two
    daemons per connection."""

    def __init__(self, netns: str, address: str, target_port: int) -> None:
        self.netns, self.address, self.target_port = netns, address, target_port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.port = 0
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def hostport(self) -> str:
        """``127.0.0.1:<port>``: what a client dials (gRPC URL form)."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> Relay:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name=f"relay-{self.netns}:{self.target_port}",
                         daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self._listener.accept()
            except OSError:
                return   # closed
            threading.Thread(target=self._connect, args=(inner,), daemon=True).start()

    def _connect(self, inner: socket.socket) -> None:
        try:
            outer = netns_socket(self.netns)
            outer.settimeout(CONNECT_TIMEOUT_S)
            outer.connect((self.address, self.target_port))
            outer.settimeout(None)
        except OSError:
            inner.close()   # the client sees the connection refused/closed, as it would without the relay
            return
        for sock in (inner, outer):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns += [inner, outer]
        threading.Thread(target=_pump, args=(inner, outer), daemon=True).start()
        threading.Thread(target=_pump, args=(outer, inner), daemon=True).start()

    def close(self) -> None:
        """Stops accepting and closes every relayed connection. Idempotent."""
        try:
            # wakes the blocked accept (close alone leaves it listening)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
