"""The fleet's rendezvous for KV managers on harness hosts: today's central bootstrap service
(``python -m bootstrap``) in a host of its own. Isolated here because the rendezvous is being redesigned
(issue #19: each instance serves its own; the central service becomes an optional registry)."""

from __future__ import annotations

import subprocess
import time
from typing import IO, Any

BOOTSTRAP_PORT = 8998


def start_bootstrap(host: Any, port: int = BOOTSTRAP_PORT, log: IO[Any] | int | None = None,
                    timeout_s: float = 60.0) -> str:
    """Starts the bootstrap service on ``host`` (a ``fleet.netns.Host``; the fleet's teardown stops it) and
    waits until it accepts connections on ``host.address:port``; returns its URL. Raises ``TimeoutError``."""
    proc: subprocess.Popen[bytes] = host.popen(["python", "-m", "bootstrap", "--host", host.address,
                                                "--port", str(port)], stdout=log, stderr=log)
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"bootstrap service on {host.name} exited with {proc.returncode}")
        probe = host.run(["python", "-c", f"import socket; socket.create_connection(('{host.address}', {port}), 1)"],
                         timeout_s=30)
        if probe.returncode == 0:
            return f"http://{host.address}:{port}"
        time.sleep(0.2)
    raise TimeoutError(f"bootstrap service on {host.name} not up in {timeout_s} s")
