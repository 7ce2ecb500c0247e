"""``scripts/fleet/relay.py``: a loopback port of this process's namespace reaches a server inside a host,
both ways, for several connections at once; the host's link down does not cut it (the relay dials the host's
own address from inside the host); a refused target closes the client's connection; ``close`` stops
accepting."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

import pytest
from fleet.netns import Fleet
from fleet.relay import Relay

pytestmark = pytest.mark.netns
MakeFleet = Callable[[Sequence[str]], Fleet]

ECHO = ("import socket, threading\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 7000)); s.listen()\n"
        "def serve(c):\n"
        "    while data := c.recv(65536): c.sendall(data.upper())\n"
        "    c.close()\n"
        "while True: threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()\n")


def roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def wait_listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if roundtrip(port, b"ping") == b"PING":
                return
        except OSError:   # not listening yet: the relay closed our connection, seen as a reset (ping unread)
            pass          # or, when it closed before our shutdown, ENOTCONN (CI, 2026-12-02); a real failure
                          # still ends in the TimeoutError below
        time.sleep(0.1)
    raise TimeoutError("the echo server inside the host did not answer")


def test_relay_reaches_a_server_inside_a_host_even_with_its_link_down(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(["a"])
    host = fleet["a"]
    host.popen(["python", "-c", ECHO])
    with Relay(host.netns, host.address, 7000) as relay:
        wait_listening(relay.port)
        payload = bytes(range(256)) * 4096 + b"abc"   # 1 MiB and a bit
        assert roundtrip(relay.port, payload) == payload.upper()
        before = host.counters()
        host.set_link(False)
        assert [roundtrip(relay.port, b"down %d" % i) for i in range(3)] == [b"DOWN %d" % i for i in range(3)]
        host.set_link(True)
        assert host.counters().tx_bytes == before.tx_bytes   # relayed bytes never touch the link
    with pytest.raises(OSError):   # closed: nothing accepts on that port any more
        roundtrip(relay.port, b"x")


def test_relay_to_a_closed_port_closes_the_clients_connection(make_fleet: MakeFleet) -> None:
    host = make_fleet(["a"])["a"]
    with Relay(host.netns, host.address, 7001) as relay, \
            socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
        assert sock.recv(1) == b""   # closed by the relay, as the refused connection was
