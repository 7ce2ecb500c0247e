"""The stub guardian: a stub's end on purpose is no death; a dead stub's model is unloaded then loaded again
(explicit model control), or its server is ended where the repository API is refused; nothing is healed on a
server that is gone. A real guardian process sees its stub's death through the pipe at once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.stub_guardian import (FINALIZE, GuardedStub, RepositoryRefused, heal, process_alive,
                                   stub_ended_on_purpose)

ROOT = Path(__file__).resolve().parents[2]
STUB = GuardedStub("prefill", "127.0.0.1:1", server_pid=os.getpid(), stub_pid=1)


class FakeRepository:
    """Records the repository calls; ``refuse`` plays control mode none, ``load_failures`` failed loads."""

    def __init__(self, live: bool = True, refuse: bool = False, load_failures: int = 0, ready: bool = True) -> None:
        self.live, self.refuse, self.load_failures, self.ready = live, refuse, load_failures, ready
        self.calls: list[str] = []

    def is_live(self) -> bool:
        if not self.live:
            raise ConnectionError("Server exiting")
        return True

    def is_model_ready(self, model: str) -> bool:
        return self.ready

    def unload(self, model: str) -> None:
        self.calls.append(f"unload {model}")
        if self.refuse:
            raise RepositoryRefused("explicit model load / unload is not allowed if polling is enabled")

    def load(self, model: str) -> None:
        self.calls.append(f"load {model}")
        if self.load_failures:
            self.load_failures -= 1
            raise RuntimeError("load failed")


def run_heal(repository: FakeRepository, stub: GuardedStub = STUB) -> tuple[str, list[GuardedStub]]:
    ended: list[GuardedStub] = []
    return heal(stub, repository, ended.append, sleep=lambda s: None), ended


def test_finalize_before_the_pipe_ends_is_an_end_on_purpose() -> None:
    assert stub_ended_on_purpose(io.BytesIO(FINALIZE))
    assert not stub_ended_on_purpose(io.BytesIO(b""))


def test_a_dead_stub_is_unloaded_then_loaded_again() -> None:
    repository = FakeRepository()
    assert run_heal(repository) == ("reloaded", [])
    assert repository.calls == ["unload prefill", "load prefill"]


def test_a_failed_load_is_retried_then_given_up() -> None:
    repository = FakeRepository(load_failures=1)
    assert run_heal(repository)[0] == "reloaded"
    assert repository.calls == ["unload prefill", "load prefill", "load prefill"]
    assert run_heal(FakeRepository(load_failures=5))[0] == "load failed"


def test_without_the_repository_api_the_server_is_ended() -> None:
    repository = FakeRepository(refuse=True)
    assert run_heal(repository) == ("server ended", [STUB])
    assert repository.calls == ["unload prefill"]


def test_nothing_is_healed_on_a_server_that_is_exiting_or_gone() -> None:
    repository = FakeRepository(live=False)
    assert run_heal(repository) == ("server gone", [])
    gone = GuardedStub("prefill", "127.0.0.1:1", server_pid=2**22 + 1, stub_pid=1)
    assert run_heal(FakeRepository(), gone) == ("server gone", [])
    assert repository.calls == []


def test_a_model_being_unloaded_is_not_reloaded() -> None:
    """Triton kills a stub that does not answer its finalize: that unload is the operator's, not a death."""
    repository = FakeRepository(ready=False)
    assert run_heal(repository) == ("not serving", [])
    assert repository.calls == []


@pytest.mark.timeout(60)
def test_a_guardian_process_exits_quietly_after_finalize_and_acts_at_once_on_a_death() -> None:
    """The real process: ``finalize`` then EOF → exit 0 at once; EOF alone (the stub died) → it heals, here
    against a server pid that is gone ("server gone"), so it exits 0 too, within a second or two."""
    def guardian() -> subprocess.Popen[bytes]:
        gone_pid = str(2**22 + 1)
        return subprocess.Popen([sys.executable, "-m", "serving.stub_guardian", "--model", "m", "--grpc-url",
                                 "127.0.0.1:1", "--server-pid", gone_pid, "--stub-pid", "1"], cwd=ROOT,
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE)

    calm = guardian()
    _, err = calm.communicate(FINALIZE, timeout=30)
    assert calm.returncode == 0 and b"died" not in err
    dead = guardian()
    time.sleep(0.5)
    assert process_alive(dead.pid)   # waiting on its pipe
    _, err = dead.communicate(b"", timeout=30)   # the write end closes: the stub "died"
    assert dead.returncode == 0 and b"its stub (pid 1) died" in err and b"server gone" in err
