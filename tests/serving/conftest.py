"""Fixtures of the serving tests: a real tritonserver (``scripts/serve.sh``) with a chosen subset of models.

A test module selects its models with a module attribute, ``TRITON_MODELS = ("colocated",)`` (and may build
its own repository with ``make_model_repository(tmp_dir) -> path``), and uses the
``triton_server`` fixture (module scope, marked ``live``). The server runs on free loopback ports
(tritonserver cannot bind port 0: ports are picked by binding), in its own process group; teardown sends
SIGTERM (serve.sh stops tritonserver), then SIGKILL after a deadline, removes the python backend
shared-memory regions its stubs left, and fails the module if shutdown was unclean (a request left without its
FINAL flag keeps tritonserver waiting until its exit timeout) or if the kernel log (``dmesg``, where readable)
reports a stub of this server killed by a fault (a stub that crashes on its way out leaves no other trace).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from perf.server import ServeScript, supervised  # noqa: E402 - needs scripts/ on sys.path

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 40.0
CLEAN_STOP_S = 15.0  # tritonserver's --exit-timeout-secs in serve.sh is 20: a hung request shows up as > 15 s


@pytest.fixture(scope="module")
def triton_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeScript]:
    """A tritonserver serving ``request.module.TRITON_MODELS`` (default: colocated) on free ports; yields its
    URLs (``http_url``, ``grpc_url``, ``metrics_url``, ``registry_url``) and ``log_tail()``."""
    models = ",".join(getattr(request.module, "TRITON_MODELS", ("colocated",)))
    try:
        import pytriton  # noqa: F401  (the tritonserver binary ships in nvidia-pytriton)
    except ImportError:
        pytest.skip("nvidia-pytriton is not installed: run scripts/setup.sh")
    make_repository = getattr(request.module, "make_model_repository", None)
    # a module that serves its own repository (e.g. xPyD) builds it here
    repository = make_repository(tmp_path_factory.mktemp("model_repository")) if make_repository else None
    # a module may set serve.sh's environment (``TRITON_ENV``, e.g. a short ``DRAIN_TIMEOUT_S``)
    # a module may serve model_repository/ itself (``SERVE_IN_PLACE``: its models' outputs from auto-complete)
    # instead of the copy with complete configs every other server gets
    server = ServeScript(models, tmp_path_factory.mktemp("triton") / "server.log", repository,
                         env=getattr(request.module, "TRITON_ENV", None),
                         in_place=getattr(request.module, "SERVE_IN_PLACE", False))
    ready_timeout_s = getattr(request.module, "READY_TIMEOUT_S", READY_TIMEOUT_S)  # a module may load more
    with supervised(server, ready_timeout_s, STOP_TIMEOUT_S, CLEAN_STOP_S):
        yield server
