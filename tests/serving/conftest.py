"""Fixtures of the serving tests: a real tritonserver (``scripts/serve.sh``) with a chosen subset of models.

A test module selects its models with a module attribute, ``TRITON_MODELS = ("colocated",)`` (and may build its
own repository with ``make_model_repository(tmp_dir) -> path``), and uses the
``triton_server`` fixture (module scope, marked ``live``). The server runs on free loopback ports (tritonserver
cannot bind port 0: ports are picked by binding), in its own process group; teardown sends SIGTERM (serve.sh
stops tritonserver and the bootstrap service), then SIGKILL after a deadline, removes the python backend
shared-memory regions its stubs left, and fails the module if shutdown was unclean (a request left without its
FINAL flag keeps tritonserver waiting until its exit timeout).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 40.0
CLEAN_STOP_S = 15.0  # tritonserver's --exit-timeout-secs in serve.sh is 20: a hung request shows up as > 15 s
SHM_PREFIX = "triton_python_backend_shm_region_"


@dataclass(frozen=True)
class TritonServer:
    """URLs of a running server. ``grpc_url`` is ``host:port`` (tritonclient.grpc); the others are http://..."""

    http_url: str
    grpc_url: str
    metrics_url: str
    bootstrap_url: str
    log_path: Path

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (bound, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _shm_regions_of_group(pgid: int) -> set[str]:
    """Shared-memory regions named on the command lines of the processes in group ``pgid`` (the stubs)."""
    regions: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        regions.update(a.decode() for a in args if a.startswith(SHM_PREFIX.encode()))
    return regions


def _wait_ready(server: TritonServer, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve.sh exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.http_url}/v2/health/ready", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tritonserver not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def _stop(proc: subprocess.Popen[bytes]) -> tuple[float, bool]:
    """SIGTERM the group, SIGKILL after ``STOP_TIMEOUT_S``; returns (seconds taken, killed)."""
    regions = _shm_regions_of_group(proc.pid)
    start = time.monotonic()
    killed = False
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        killed = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    elapsed = time.monotonic() - start
    try:  # stragglers of the group (stubs survive a crashed server)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for region in regions:
        Path("/dev/shm", region).unlink(missing_ok=True)
    return elapsed, killed


@pytest.fixture(scope="module")
def triton_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A tritonserver serving ``request.module.TRITON_MODELS`` (default: colocated) on free ports."""
    models = ",".join(getattr(request.module, "TRITON_MODELS", ("colocated",)))
    try:
        import pytriton  # noqa: F401  (the tritonserver binary ships in nvidia-pytriton)
    except ImportError:
        pytest.skip("nvidia-pytriton is not installed: run scripts/setup.sh")
    http, grpc, metrics, bootstrap = free_ports(4)
    log_path = tmp_path_factory.mktemp("triton") / "server.log"
    env = {**os.environ, "SKIP_SETUP": "1", "MODELS": models, "HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
           "METRICS_PORT": str(metrics), "BOOTSTRAP_PORT": str(bootstrap)}
    make_repository = getattr(request.module, "make_model_repository", None)
    if make_repository is not None:  # a module that serves its own repository (e.g. xPyD) builds it here
        env["MODEL_REPOSITORY"] = str(make_repository(tmp_path_factory.mktemp("model_repository")))
    server = TritonServer(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics",
                          f"http://127.0.0.1:{bootstrap}", log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(ROOT / "scripts" / "serve.sh")], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(server, proc, READY_TIMEOUT_S)
        yield server
    finally:
        elapsed, killed = _stop(proc)
    assert not killed and elapsed < CLEAN_STOP_S, \
        f"unclean shutdown ({elapsed:.1f} s, killed={killed}):\n{server.log_tail()}"
