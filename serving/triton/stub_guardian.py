"""``python -m serving.triton.stub_guardian``: the small process that watches one python-backend stub and its
tritonserver (``serving.triton.stub_guard`` starts it first thing in the stub's ``initialize``).

It watches two things at once: its stdin, a pipe only its stub writes, and tritonserver itself (a pidfd: the
kernel wakes it the moment tritonserver exits, whatever holds the stub's GIL). What the stub writes:
``ready <json>`` once its model works (the server's gRPC endpoint and TLS, for the health checks below), then
``finalize`` when its model is being unloaded or its server stops (an end on purpose from then on).

Lifecycle of one guardian:

1. tritonserver exits while the stub still runs (it was killed, or crashed, or its exit timeout expired under
   a slow ``finalize``): the guardian SIGKILLs the stub at once and removes its shared-memory region. Left
   alone, python_backend's stub notices the dead parent within 300 ms and tears itself down with ``exit(1)``
   from its health thread while its other threads still run (``pb_stub.cc``, "Non-graceful termination
   detected"): the model's ``initialize`` or ``finalize`` under way then crashes in libc, in
   ``boost::interprocess`` ("terminate called ...") or in Python (faulthandler's "Fatal Python error:
   Segmentation fault"), or the stub hangs in its own exit; and nothing removes
   ``/dev/shm/triton_python_backend_shm_region_*`` (docs/healing.md, "Stops").
2. The pipe ends after ``finalize``, or before ``ready`` (a load that failed or was stopped: tritonserver
   reports it): nothing to heal; it exits.
3. The pipe ends after ``ready`` without ``finalize``: the stub died. If tritonserver is gone or exiting too,
   or the model is not READY (an unload under way: Triton itself kills a stub that does not answer its
   finalize), nothing to heal; it exits.
4. Otherwise the model can never serve again in this server (tritonserver 2.51 never restarts the stub of a
   decoupled model), yet Triton reports it READY for good. The guardian ends the server: SIGTERM (the other
   models drain and end their requests: their server watch), then SIGKILL once every other stub of the server
   is gone (or after the drain timeout + ``FINALIZE_MARGIN_S``): tritonserver would otherwise wait its whole
   exit timeout for the dead model's requests, whose responses it never releases, or abort while freeing that
   instance. The supervisor (serve.sh, Kubernetes, systemd, docker's restart policy) starts the server again.

Why not reload the model through the repository API (explicit model control): it works, but destroying the
dead stub's instance corrupted tritonserver's heap in 2 of 3 PD runs here (``malloc_consolidate(): unaligned
fastbin chunk detected`` on the next request, then a hang in Triton's signal handler): docs/healing.md.

SIGINT and SIGTERM are ignored: a Ctrl-C or a SIGTERM to the server's whole process group is the server's to
act on, and this process must outlive it to do (1). It always ends with its stub (the pipe's end).

Logs go to stderr, which is the stub's: the server log.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Protocol

from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger("serving.triton.stub_guardian")

FINALIZE = b"finalize\n"
READY = b"ready "
#: The other models' drain after a stub's death, when the stub did not say its own (``ready_line``), seconds.
DRAIN_TIMEOUT_S = 30.0
#: What the other stubs of an ended server get on top of their drain to end the rest and finalize, seconds.
FINALIZE_MARGIN_S = 15.0
#: How long a stub killed after its server's death may take to go, seconds (a SIGKILL: at once, unless the
#: kernel is busy tearing down its memory).
KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class GuardedStub:
    """The stub one guardian watches.

    Attributes:
        model: the Triton model the stub serves.
        grpc_url: ``host:port`` of the server's gRPC endpoint (from the stub's ``ready`` line; "" before).
        server_pid: tritonserver's pid (the stub's parent).
        stub_pid: the stub's pid.
        shm_region: the stub's shared-memory region name (removed once its server is gone).
        tls: TLS of the health checks' channel (from the ``ready`` line); None: plaintext.
        drain_timeout_s: the model's ``drain_timeout_s`` (from the ``ready`` line): how long the server's
            other models drain once the guardian ended it, seconds.
    """

    model: str
    grpc_url: str
    server_pid: int
    stub_pid: int
    shm_region: str = ""
    tls: GrpcTls | None = None
    drain_timeout_s: float = DRAIN_TIMEOUT_S


class Health(Protocol):
    """Triton's health API, as the guardian uses it (tritonclient.grpc in production)."""

    def is_live(self) -> bool:
        """Server liveness; raises when unreachable or exiting."""
        ...

    def is_model_ready(self, model: str) -> bool:
        """Whether Triton reports ``model`` READY; raises when unreachable."""
        ...


def ready_line(grpc_url: str, tls: GrpcTls | None, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> bytes:
    """The line a stub writes once its model works: its server's gRPC endpoint, the TLS to dial it with, and
    its drain timeout (seconds)."""
    paths = None if tls is None else [tls.root_cert, tls.client_cert, tls.client_key, tls.target_name]
    body = {"grpc_url": grpc_url, "tls": paths, "drain_timeout_s": drain_timeout_s}
    return READY + json.dumps(body).encode() + b"\n"


@dataclass
class PipeState:
    """What the stub's pipe has said so far."""

    ready: dict | None = None   # the ``ready`` line's body
    on_purpose: bool = False    # ``finalize`` seen
    ended: bool = False         # end-of-file: the stub closed it or died
    _partial: bytes = b""

    def feed(self, data: bytes) -> None:
        """Take the next bytes read from the pipe (``b""``: end-of-file)."""
        if not data:
            self.ended = True
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line + b"\n" == FINALIZE:
                self.on_purpose = True
            elif line.startswith(READY):
                try:
                    self.ready = json.loads(line[len(READY):])
                except ValueError:
                    logger.warning("a malformed ready line from the stub: %r", line[:200])


def stub_ended_on_purpose(stream: BinaryIO) -> bool:
    """Blocks until ``stream`` (the stub's pipe) ends; True when the stub wrote ``finalize``."""
    state = PipeState()
    while not state.ended:
        state.feed(stream.read(64))
    return state.on_purpose


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def parent_of(pid: int) -> int | None:
    """``pid``'s parent pid; None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


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
    logger.error("%s: the model's stub (pid %d) died and tritonserver cannot start it again; ending "
                 "tritonserver (pid %d) for its supervisor to restart", stub.model, stub.stub_pid,
                 stub.server_pid)
    end_server(stub)
    return "server ended"


def end_server(stub: GuardedStub) -> None:
    """SIGTERM tritonserver (its other models drain, then end what is left); SIGKILL it once its other stubs
    are gone (they finalized) or after ``stub.drain_timeout_s`` + ``FINALIZE_MARGIN_S``; then remove the dead
    stub's shared-memory region."""
    os.kill(stub.server_pid, signal.SIGTERM)
    deadline = time.monotonic() + stub.drain_timeout_s + FINALIZE_MARGIN_S
    while process_alive(stub.server_pid) and time.monotonic() < deadline:
        if not any(process_alive(pid) for pid in stub_children(stub.server_pid)):
            break
        time.sleep(0.2)
    if process_alive(stub.server_pid):
        os.kill(stub.server_pid, signal.SIGKILL)
    remove_region(stub)


def remove_region(stub: GuardedStub) -> None:
    """Remove the stub's shared-memory region (its server, which would have, is gone)."""
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


#: How often the server's pid is checked where the kernel has no pidfds (before Linux 5.3), seconds.
POLL_S = 0.05


class NoPidfd(Exception):
    """This kernel cannot make pidfds (``pidfd_open``: before Linux 5.3)."""


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits); None when it is gone already. Raises ``NoPidfd`` where the
    kernel has none."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError as e:
        raise NoPidfd(str(e)) from None


def wait_pipe_or_exit(pipe_fd: int, server_fd: int | None, server_pid: int) -> bool:
    """Block until the stub's pipe is readable (True) or the server exited (False); without a pidfd the
    server's pid is checked every ``POLL_S``."""
    while True:
        watched = [pipe_fd] if server_fd is None else [pipe_fd, server_fd]
        readable, _, _ = select.select(watched, [], [], None if server_fd is not None else POLL_S)
        if pipe_fd in readable:   # first: a stub that exited with its server is no orphan
            return True
        if server_fd in readable or (server_fd is None and not process_alive(server_pid)):
            return False


def kill_orphaned_stub(stub: GuardedStub, stub_fd: int | None) -> None:
    """tritonserver is gone and the stub still runs: SIGKILL it (through its pidfd: never another process that
    took its pid; by pid where the kernel has no pidfds), wait for it to go, and remove its shared-memory
    region."""
    try:
        if stub_fd is not None:
            signal.pidfd_send_signal(stub_fd, signal.SIGKILL)
            select.select([stub_fd], [], [], KILL_WAIT_S)
        else:
            os.kill(stub.stub_pid, signal.SIGKILL)
            deadline = time.monotonic() + KILL_WAIT_S
            while process_alive(stub.stub_pid) and time.monotonic() < deadline:
                time.sleep(POLL_S)
    except ProcessLookupError:
        pass
    remove_region(stub)


def grpc_health(stub: GuardedStub) -> Health:
    """``GrpcHealth`` of the stub's server, at the endpoint and with the TLS of its ``ready`` line."""
    return GrpcHealth(stub.grpc_url, tls=stub.tls)


def guard(stub: GuardedStub, pipe_fd: int, make_health: Callable[[GuardedStub], Health] = grpc_health,
          end: Callable[[GuardedStub], None] = end_server) -> str:
    """Watch the stub's pipe and its server until one of them ends (module docstring); returns the outcome:
    ``"stub killed"`` (the server died first), ``"ended on purpose"``, ``"never ready"``, or ``heal``'s."""
    try:
        server_fd, stub_fd = open_pidfd(stub.server_pid), open_pidfd(stub.stub_pid)
        have_pidfds = True
    except NoPidfd:
        server_fd = stub_fd = None
        have_pidfds = False
    state = PipeState()
    try:
        if (have_pidfds and server_fd is None) or parent_of(stub.stub_pid) != stub.server_pid:   # gone
            server_gone = True
        else:
            server_gone = False
            while not state.ended:
                if not wait_pipe_or_exit(pipe_fd, server_fd, stub.server_pid):
                    server_gone = True
                    break
                state.feed(os.read(pipe_fd, 4096))
        if server_gone and not state.ended and process_alive(stub.stub_pid) \
                and (stub_fd is not None or not have_pidfds):
            logger.warning("%s: tritonserver (pid %d) is gone and its stub (pid %d) still runs: killing the "
                           "stub and removing its shared memory", stub.model, stub.server_pid, stub.stub_pid)
            kill_orphaned_stub(stub, stub_fd)
            return "stub killed"
    finally:
        for fd in (server_fd, stub_fd):
            if fd is not None:
                os.close(fd)
    if state.on_purpose:
        return "ended on purpose"
    if state.ready is None:
        return "never ready"   # a load that failed or was stopped: tritonserver reports it
    tls = state.ready.get("tls")
    armed = replace(stub, grpc_url=str(state.ready.get("grpc_url", "")), tls=GrpcTls(*tls) if tls else None,
                    drain_timeout_s=float(state.ready.get("drain_timeout_s", DRAIN_TIMEOUT_S)))
    # not an error yet: a server that stops (its exit timeout expiring) ends its stubs without a finalize too;
    # ``heal`` logs the error when the stub died under a server that still serves
    logger.warning("%s: its stub (pid %d) ended without a finalize; checking its server", stub.model,
                   stub.stub_pid)
    return heal(armed, make_health(armed), end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--stub-pid", type=int, required=True)
    parser.add_argument("--shm-region", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # a Ctrl-C or SIGTERM to the server's process group is the server's to act on; this process ends with its
    # stub
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stub = GuardedStub(args.model, "", args.server_pid, args.stub_pid, args.shm_region)
    outcome = guard(stub, sys.stdin.buffer.fileno())
    if outcome not in ("ended on purpose", "never ready", "stub killed"):
        (logger.warning if outcome == "server ended" else logger.info)("%s: %s", stub.model, outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
