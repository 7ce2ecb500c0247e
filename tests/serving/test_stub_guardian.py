"""The stub guardian: a stub's end on purpose is no death; a dead stub's server is ended for its supervisor to
restart, unless the server is gone or exiting, or the model is being unloaded, or the stub never got ready. A
real guardian process sees its stub's death through the pipe at once, and its server's death through a pidfd:
a stub
left running by a dead server is killed at once and its shared memory removed."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.triton.stub_guardian import (
    FINALIZE,
    GuardedStub,
    PipeState,
    heal,
    process_alive,
    ready_line,
    stub_ended_on_purpose,
)

ROOT = Path(__file__).resolve().parents[2]
STUB = GuardedStub("prefill", "127.0.0.1:1", server_pid=os.getpid(), stub_pid=1)


class FakeHealth:
    """Triton's health answers: ``live`` False plays "Server exiting", ``ready`` False an unload under way."""

    def __init__(self, live: bool = True, ready: bool = True) -> None:
        self.live, self.ready = live, ready

    def is_live(self) -> bool:
        if not self.live:
            raise ConnectionError("Server exiting")
        return True

    def is_model_ready(self, model: str) -> bool:
        return self.ready


def run_heal(health: FakeHealth, stub: GuardedStub = STUB) -> tuple[str, list[GuardedStub]]:
    ended: list[GuardedStub] = []
    return heal(stub, health, ended.append), ended


def test_finalize_before_the_pipe_ends_is_an_end_on_purpose() -> None:
    assert stub_ended_on_purpose(io.BytesIO(FINALIZE))
    assert stub_ended_on_purpose(io.BytesIO(ready_line("h:1", None) + FINALIZE))
    assert not stub_ended_on_purpose(io.BytesIO(b""))


def test_the_ready_line_carries_the_endpoint_and_survives_split_reads() -> None:
    state, data = PipeState(), ready_line("10.0.0.1:8001", None)
    for i in range(0, len(data), 3):
        state.feed(data[i:i + 3])
    assert state.ready == {"grpc_url": "10.0.0.1:8001", "tls": None, "drain_timeout_s": 30.0}
    assert not state.on_purpose and not state.ended
    state.feed(b"")
    assert state.ended


def test_a_dead_stub_of_a_ready_model_ends_its_server() -> None:
    assert run_heal(FakeHealth()) == ("server ended", [STUB])


def test_nothing_is_healed_on_a_server_that_is_exiting_or_gone() -> None:
    assert run_heal(FakeHealth(live=False)) == ("server gone", [])
    gone = GuardedStub("prefill", "127.0.0.1:1", server_pid=2**22 + 1, stub_pid=1)
    assert run_heal(FakeHealth(), gone) == ("server gone", [])


def test_a_model_being_unloaded_is_not_healed() -> None:
    """Triton kills a stub that does not answer its finalize: that unload is the operator's, not a death."""
    assert run_heal(FakeHealth(ready=False)) == ("not serving", [])


class FakeServer:
    """A process standing in for tritonserver, with one child standing in for its stub (the guardian checks
    that the stub's parent is the server)."""

    def __init__(self) -> None:
        code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(120)']); print(c.pid, flush=True); time.sleep(120)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.stub_pid = int(self.proc.stdout.readline())

    def guardian(self, shm_region: str = "") -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "serving.triton.stub_guardian", "--model", "m",
                                 "--server-pid", str(self.proc.pid), "--stub-pid", str(self.stub_pid),
                                 "--shm-region", shm_region], cwd=ROOT, stdin=subprocess.PIPE,
                                stderr=subprocess.PIPE)

    def close(self) -> None:
        for pid in (self.stub_pid, self.proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.mark.timeout(60)
def test_a_guardian_exits_quietly_after_finalize_or_a_load_that_never_got_ready(server: FakeServer) -> None:
    calm = server.guardian()
    _, err = calm.communicate(ready_line("127.0.0.1:1", None) + FINALIZE, timeout=30)
    assert calm.returncode == 0 and b"without a finalize" not in err and b"killing" not in err
    failed_load = server.guardian()
    _, err = failed_load.communicate(b"", timeout=30)   # the pipe ends before ready: a failed or stopped load
    assert failed_load.returncode == 0 and b"without a finalize" not in err
    assert process_alive(server.stub_pid) and process_alive(server.proc.pid)


@pytest.mark.timeout(60)
def test_a_guardian_checks_the_server_when_its_ready_stub_dies(server: FakeServer) -> None:
    """EOF after ready without finalize: the stub died; the server's endpoint answers nothing here, so the
    guardian finds nothing to heal ("server gone") and exits, within a second or two."""
    dead = server.guardian()
    assert dead.stdin is not None
    dead.stdin.write(ready_line("127.0.0.1:1", None))
    dead.stdin.flush()
    time.sleep(0.5)
    assert process_alive(dead.pid)   # waiting on its pipe and on the server
    _, err = dead.communicate(b"", timeout=30)
    assert dead.returncode == 0 and b"ended without a finalize" in err and b"server gone" in err


@pytest.mark.timeout(60)
def test_a_server_that_dies_under_its_running_stub_has_the_stub_killed_at_once(server: FakeServer) -> None:
    """tritonserver killed while the stub loads its model (or drains): the guardian kills the stub at once
    (python_backend's own teardown of an orphaned stub crashes it) and removes its shared-memory region."""
    region = Path("/dev/shm", f"triton_python_backend_shm_region_guardian_test_{os.getpid()}")
    region.write_bytes(b"x")
    try:
        guardian = server.guardian(region.name)
        time.sleep(2.0)   # the guardian watches (its python has started, also on a loaded machine)
        killed = time.monotonic()
        os.kill(server.proc.pid, 9)
        server.proc.wait(10)
        guardian.wait(30)   # its stdin stays open: the stub lives, only its server died
        assert guardian.stderr is not None and guardian.stdin is not None
        err = guardian.stderr.read()
        guardian.stdin.close()
        while process_alive(server.stub_pid) and time.monotonic() - killed < 10:
            time.sleep(0.01)
        assert not process_alive(server.stub_pid) and time.monotonic() - killed < 5.0, err
        assert guardian.returncode == 0 and b"killing the stub" in err and not region.exists()
    finally:
        region.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_without_pidfds_the_server_is_polled_and_an_orphaned_stub_still_killed(
        server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without ``pidfd_open`` (before Linux 5.3): the guardian polls the server's pid instead."""
    import threading

    from serving.triton import stub_guardian

    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(stub_guardian.os, "pidfd_open", no_pidfd)
    read_fd, write_fd = os.pipe()
    outcome: list[str] = []
    stub = GuardedStub("m", "", server.proc.pid, server.stub_pid)
    watcher = threading.Thread(target=lambda: outcome.append(stub_guardian.guard(stub, read_fd)))
    watcher.start()
    try:
        time.sleep(0.3)
        assert watcher.is_alive() and process_alive(server.stub_pid)   # the server lives: nothing to do
        os.kill(server.proc.pid, 9)
        server.proc.wait(10)
        watcher.join(10)
        assert outcome == ["stub killed"] and not process_alive(server.stub_pid)
    finally:
        os.close(write_fd)
        watcher.join(10)
        os.close(read_fd)
