"""The stub guardian: a stub's end on purpose is no death; a dead stub's server is ended for its supervisor to
restart, unless the server is gone or exiting, or the model is being unloaded. A real guardian process sees its
stub's death through the pipe at once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.triton.stub_guardian import FINALIZE, GuardedStub, heal, process_alive, stub_ended_on_purpose

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
    assert not stub_ended_on_purpose(io.BytesIO(b""))


def test_a_dead_stub_of_a_ready_model_ends_its_server() -> None:
    assert run_heal(FakeHealth()) == ("server ended", [STUB])


def test_nothing_is_healed_on_a_server_that_is_exiting_or_gone() -> None:
    assert run_heal(FakeHealth(live=False)) == ("server gone", [])
    gone = GuardedStub("prefill", "127.0.0.1:1", server_pid=2**22 + 1, stub_pid=1)
    assert run_heal(FakeHealth(), gone) == ("server gone", [])


def test_a_model_being_unloaded_is_not_healed() -> None:
    """Triton kills a stub that does not answer its finalize: that unload is the operator's, not a death."""
    assert run_heal(FakeHealth(ready=False)) == ("not serving", [])


@pytest.mark.timeout(60)
def test_a_guardian_process_exits_quietly_after_finalize_and_acts_at_once_on_a_death() -> None:
    """The real process: ``finalize`` then EOF → exit 0 at once; EOF alone (the stub died) → it heals, here
    against a server pid that is gone ("server gone"), so it exits 0 too, within a second or two."""
    def guardian() -> subprocess.Popen[bytes]:
        gone_pid = str(2**22 + 1)
        return subprocess.Popen([sys.executable, "-m", "serving.triton.stub_guardian", "--model", "m", "--grpc-url",
                                 "127.0.0.1:1", "--server-pid", gone_pid, "--stub-pid", "1"], cwd=ROOT,
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE)

    calm = guardian()
    _, err = calm.communicate(FINALIZE, timeout=30)
    assert calm.returncode == 0 and b"without a finalize" not in err
    dead = guardian()
    time.sleep(0.5)
    assert process_alive(dead.pid)   # waiting on its pipe
    _, err = dead.communicate(b"", timeout=30)   # the write end closes: the stub "died"
    assert dead.returncode == 0 and b"its stub (pid 1) ended without a finalize" in err and b"server gone" in err
