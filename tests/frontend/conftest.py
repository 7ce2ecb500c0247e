"""Live fixture of the front's tests: ``scripts/serve.sh`` (the README's command, set-up skipped) serving
``pd_ensemble`` + ``prefill`` + ``decode`` and the OpenAI front (``OPENAI=1``) on free loopback ports, one
start per module; teardown fails the module when shutdown was unclean (a request left without FINAL keeps
tritonserver waiting) or a stub died by a fault, as in tests/serving/conftest.py."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from perf.server import ServeScript, free_ports, supervised  # noqa: E402 - scripts/ is on sys.path (above)

READY_TIMEOUT_S = 180.0
FRONT_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 40.0
CLEAN_STOP_S = 15.0


@dataclass(frozen=True)
class Stack:
    """The running server and front: ``server`` (ServeScript: grpc_url, metrics_url, ...), ``openai_url``
    (``http://127.0.0.1:<port>/v1``) and the Triton model behind it."""

    server: ServeScript
    openai_url: str
    model: str = "pd_ensemble"


def _wait_healthy(url: str, server: ServeScript, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(
        f"the OpenAI front is not healthy at {url} within {timeout_s:.0f} s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def openai_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        import pytriton  # noqa: F401  (the tritonserver binary ships in nvidia-pytriton)
    except ImportError:
        pytest.skip("nvidia-pytriton is not installed: run scripts/setup.sh")
    *ports, openai_port = free_ports(5)
    server = ServeScript("pd_ensemble,prefill,decode", tmp_path_factory.mktemp("triton") / "server.log",
                         env={"OPENAI": "1", "OPENAI_PORT": str(openai_port)}, ports=ports)
    ready_timeout_s = getattr(request.module, "READY_TIMEOUT_S", READY_TIMEOUT_S)  # a module may ask longer
    with supervised(server, ready_timeout_s, STOP_TIMEOUT_S, CLEAN_STOP_S):
        _wait_healthy(f"http://127.0.0.1:{openai_port}/health", server, FRONT_READY_TIMEOUT_S)
        yield Stack(server, f"http://127.0.0.1:{openai_port}/v1")
