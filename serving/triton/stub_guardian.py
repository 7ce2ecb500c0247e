"""``python -m serving.triton.stub_guardian``: end a tritonserver whose python-backend stub died, for its supervisor to
start it again (the process ``serving.triton.stub_guard`` starts for each engine model's stub).

Lifecycle of one guardian:

1. It reads its stdin, the pipe only its stub writes, until end-of-file.
2. ``finalize`` read first: the model is being unloaded or the server stops; it exits.
3. End-of-file alone: the stub died. If tritonserver is gone or exiting too, or the model is not READY (an
   unload under way: Triton itself kills a stub that does not answer its finalize), nothing to heal; it exits.
4. Otherwise the model can never serve again in this server (tritonserver 2.51 never restarts the stub of a
   decoupled model), yet Triton reports it READY for good. The guardian ends the server: SIGTERM (the other
   models end their requests with an error and FINAL: their server watch), then SIGKILL once every other stub of
   the server is gone (or after ``DRAIN_TIMEOUT_S``): tritonserver would otherwise wait its whole exit timeout
   for the dead model's requests, whose responses it never releases, or abort while freeing that instance. The
   supervisor (serve.sh, Kubernetes, systemd, docker's restart policy) starts the server again.

Why not reload the model through the repository API (explicit model control): it works, but destroying the dead
stub's instance corrupted tritonserver's heap in 2 of 3 PD runs here (``malloc_consolidate(): unaligned fastbin
chunk detected`` on the next request, then a hang in Triton's signal handler): docs/healing.md.

Logs go to stderr, which is the stub's: the server log.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger("serving.triton.stub_guardian")

FINALIZE = b"finalize\n"
DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GuardedStub:
    """The stub one guardian watches.

    Attributes:
        model: the Triton model the stub serves.
        grpc_url: ``host:port`` of the server's gRPC endpoint.
        server_pid: tritonserver's pid (the stub's parent).
        stub_pid: the stub's pid.
        shm_region: the stub's shared-memory region name (removed once a server the guardian ended is gone).
    """

    model: str
    grpc_url: str
    server_pid: int
    stub_pid: int
    shm_region: str = ""


class Health(Protocol):
    """Triton's health API, as the guardian uses it (tritonclient.grpc in production)."""

    def is_live(self) -> bool:
        """Server liveness; raises when unreachable or exiting."""
        ...

    def is_model_ready(self, model: str) -> bool:
        """Whether Triton reports ``model`` READY; raises when unreachable."""
        ...


def stub_ended_on_purpose(stream: BinaryIO) -> bool:
    """Blocks until ``stream`` (the stub's pipe) ends; True when the stub wrote ``finalize`` first."""
    seen = b""
    while chunk := stream.read(64):
        seen += chunk
    return FINALIZE in seen


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def heal(stub: GuardedStub, health: Health, end_server: Callable[[GuardedStub], None]) -> str:
    """After the stub died: end its server unless there is nothing to heal.

    Returns the outcome: ``"server ended"``, or ``"server gone"`` / ``"not serving"`` (nothing to heal).
    """
    try:
        if not process_alive(stub.server_pid) or not health.is_live():
            return "server gone"
        if not health.is_model_ready(stub.model):
            return "not serving"
    except Exception:   # unreachable or "Server exiting": the server is going away with its stub
        return "server gone"
    logger.error("%s: the model's stub (pid %d) died and tritonserver cannot start it again; ending tritonserver "
                 "(pid %d) for its supervisor to restart", stub.model, stub.stub_pid, stub.server_pid)
    end_server(stub)
    return "server ended"


def end_server(stub: GuardedStub, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """SIGTERM tritonserver; SIGKILL it once its other stubs are gone (they finalized) or after
    ``drain_timeout_s``; then remove the dead stub's shared-memory region."""
    os.kill(stub.server_pid, signal.SIGTERM)
    deadline = time.monotonic() + drain_timeout_s
    while process_alive(stub.server_pid) and time.monotonic() < deadline:
        if not any(process_alive(pid) for pid in stub_children(stub.server_pid)):
            break
        time.sleep(0.2)
    if process_alive(stub.server_pid):
        os.kill(stub.server_pid, signal.SIGKILL)
    if stub.shm_region:
        Path("/dev/shm", stub.shm_region).unlink(missing_ok=True)


def stub_children(server_pid: int, proc: Path = Path("/proc")) -> Iterable[int]:
    """PIDs of the python-backend stubs whose parent is ``server_pid``."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) != server_pid:
                continue
            if b"triton_python_backend_stub" in (entry / "cmdline").read_bytes():
                yield int(entry.name)
        except (OSError, ValueError, IndexError):
            continue


class GrpcHealth:
    """``Health`` over tritonclient.grpc."""

    def __init__(self, grpc_url: str, timeout_s: float = 5.0, tls: GrpcTls | None = None) -> None:
        from serving.triton.control_client import control_client

        self._client = control_client(grpc_url, tls)
        self._timeout_s = timeout_s

    def is_live(self) -> bool:
        return bool(self._client.is_server_live(client_timeout=self._timeout_s))

    def is_model_ready(self, model: str) -> bool:
        return bool(self._client.is_model_ready(model, client_timeout=self._timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--grpc-url", required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--stub-pid", type=int, required=True)
    parser.add_argument("--shm-region", default="")
    parser.add_argument("--grpc-ssl-root-cert", default="", help="TLS to the server's gRPC (GrpcTls)")
    parser.add_argument("--grpc-ssl-client-cert", default="")
    parser.add_argument("--grpc-ssl-client-key", default="")
    parser.add_argument("--grpc-ssl-target-name", default="")
    args = parser.parse_args(argv)
    tls = GrpcTls(args.grpc_ssl_root_cert, args.grpc_ssl_client_cert, args.grpc_ssl_client_key,
                  args.grpc_ssl_target_name) if args.grpc_ssl_root_cert else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C of serve.sh's group is the server's to handle
    stub = GuardedStub(args.model, args.grpc_url, args.server_pid, args.stub_pid, args.shm_region)
    if stub_ended_on_purpose(sys.stdin.buffer):
        return 0
    died_s = time.monotonic()
    # not an error yet: a server that stops (its exit timeout expiring) ends its stubs without a finalize too;
    # ``heal`` logs the error when the stub died under a server that still serves
    logger.warning("%s: its stub (pid %d) ended without a finalize; checking its server", stub.model, stub.stub_pid)
    outcome = heal(stub, GrpcHealth(stub.grpc_url, tls=tls), end_server)
    log = logger.warning if outcome == "server ended" else logger.info
    log("%s: %s %.1f s after the stub's end", stub.model, outcome, time.monotonic() - died_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
