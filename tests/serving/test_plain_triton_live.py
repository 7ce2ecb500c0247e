"""Plain ``tritonserver --model-repository=model_repository``: the deployment this project is named by, with
nothing started beside it and no ``PD_*`` (or ``UCX_*``) variable: only the stub's python able to import the
project (the venv first on ``PATH``, the repository on ``PYTHONPATH``), as any python-backend model needs, and
tritonserver's default gRPC keepalive policy (no ``--grpc-*`` flag).

Invariants: every model of the repository loads; ``pd_ensemble`` finds the prefill and decode models of its
own server (repository index + describe) and streams the colocated engine's greedy text, as ``colocated``
does, also for a request sent the moment tritonserver says ready (as a user's first request is, before the
router has read its workers); the only processes are tritonserver and its stubs; SIGTERM stops it cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_client import StreamResult, grpc_generate, make_inputs, metric_value, streams_match_reference
from live_prompts import PROMPTS, colocated_greedy_texts
from perf.server import REPO_ROOT, free_ports, stub_pids, tritonserver_paths, wait_ready

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(900)]
GREEDY = {"max_tokens": "12", "temperature": "0"}
READY_S = 300.0
CLEAN_STOP_S = 15.0


class PlainTriton:
    def __init__(self, log_path: Path) -> None:
        self.http, self.grpc, self.metrics = free_ports(3)   # not Triton's defaults: found from its argv
        self.log_path = log_path
        binary, backends = tritonserver_paths()
        self.argv = [str(binary), f"--model-repository={REPO_ROOT / 'model_repository'}",
                     f"--backend-directory={backends}",   # where this pip-installed tritonserver keeps them
                     f"--http-port={self.http}", f"--grpc-port={self.grpc}", f"--metrics-port={self.metrics}"]
        venv_bin = Path(sys.executable).parent
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PD_", "UCX_", "PYTHONPATH"))}
        self.env.update(PATH=f"{venv_bin}:{os.environ['PATH']}", PYTHONPATH=str(REPO_ROOT))
        self.proc: subprocess.Popen[bytes] | None = None
        # the pd_ensemble request sent the moment the server was ready
        self.first: StreamResult | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_ready(f"http://127.0.0.1:{self.http}", self.proc, READY_S, self.log_tail)
        self.first = grpc_generate(self.grpc_url, make_inputs(PROMPTS[0], GREEDY), model="pd_ensemble")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if metric_value(self.metrics_url, "pd_router_ready") == 1:
                    return
            except (KeyError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"the router never saw its server's prefill and decode:\n{self.log_tail()}")

    def stop(self) -> float:
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return time.monotonic() - started

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainTriton]:
    pytest.importorskip("pytriton")
    server = PlainTriton(tmp_path_factory.mktemp("plain") / "tritonserver.log")
    try:
        server.start()
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            elapsed = server.stop()
            assert elapsed < CLEAN_STOP_S and server.proc.returncode == 0, \
                f"unclean stop ({elapsed:.1f} s, status {server.proc.returncode}):\n{server.log_tail()}"


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS, GREEDY)


@pytest.mark.parametrize("model", ["pd_ensemble", "colocated"])
def test_plain_tritonserver_streams_the_colocated_text(plain: PlainTriton, reference: dict[str, str],
                                                       model: str) -> None:
    streams_match_reference(lambda p: grpc_generate(plain.grpc_url, make_inputs(p, GREEDY), model=model),
                            PROMPTS, reference)


def test_a_request_sent_the_moment_tritonserver_is_ready_gets_the_colocated_text(
        plain: PlainTriton, reference: dict[str, str]) -> None:
    """Triton's readiness says the models loaded, not that the router has read its workers yet: the first
    request waits for them (``fleet_wait_s``) instead of failing with "no healthy ... instance"."""
    assert plain.first is not None and plain.first.error is None and plain.first.final_seen, plain.first
    assert plain.first.text == reference[PROMPTS[0]]


def test_nothing_runs_beside_tritonserver_and_its_stubs(plain: PlainTriton) -> None:
    assert plain.proc is not None
    children = subprocess.run(["pgrep", "-P", str(plain.proc.pid)], capture_output=True, text=True,
                              check=False).stdout.split()
    names = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() for pid in children}
    assert names and all(name.endswith("triton_python_backend_stub") for name in names), names
    assert metric_value(plain.metrics_url, "pd_requests_total", model="prefill", outcome="finished") >= 1


def _may_raise_priority() -> bool:
    """True when this process (and so the tritonserver it starts) holds ``CAP_SYS_NICE`` (bit 23)."""
    status = Path("/proc/self/status").read_text().splitlines()
    caps = next(line for line in status if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> 23 & 1)


def test_each_engine_thread_alone_runs_at_the_configured_nice(plain: PlainTriton) -> None:
    """``engine_nice`` (-10 by default): in each engine's stub the engine loop thread, and no other thread,
    runs at -10 where the server may raise a priority; elsewhere none does (the loop logs why). The router's
    stub has no engine."""
    raised = {model: sum(os.getpriority(os.PRIO_PROCESS, int(tid)) == -10
                         for pid in stub_pids(REPO_ROOT / "model_repository" / model)
                         for tid in os.listdir(f"/proc/{pid}/task"))
              for model in ("colocated", "prefill", "decode", "pd_ensemble")}
    expected = 1 if _may_raise_priority() else 0
    assert raised == {"colocated": expected, "prefill": expected, "decode": expected, "pd_ensemble": 0}


@pytest.mark.parametrize("model", ["prefill", "decode"])
def test_a_client_calling_a_worker_model_directly_gets_a_readable_400(plain: PlainTriton, model: str) -> None:
    """``prefill``/``decode`` are the router's: a client's own request (no ``child_schema``) lacks the
    bootstrap room; its error is a Triton error (HTTP 400, the message as text), not the child layout's
    bytes."""
    import requests

    response = requests.post(f"http://127.0.0.1:{plain.http}/v2/models/{model}/generate",
                             json={"text_input": "hi"}, timeout=30)
    assert response.status_code == 400, response.text
    assert "bootstrap_room" in response.json()["error"], response.text
