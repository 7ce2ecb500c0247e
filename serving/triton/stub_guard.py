"""``StubGuard``: the stub's half of dead-stub healing; it starts the stub's guardian process and, in ``finalize``,
tells it that this stub ends on purpose.

tritonserver 2.51's python backend never restarts a dead stub of a decoupled model and keeps reporting the model
ready (r24.10 ``src/python_be.cc``: "TODO: Implement restart on decoupled"). Nothing inside the dead stub can act,
and tritonserver does not ask it: the guardian (``serving.triton.stub_guardian``, a small process of its own) holds the
read end of a pipe whose only write end is this stub's. A stub that dies in any way (``kill -9``, a segfault, the
OOM killer) closes it, and the guardian sees end-of-file at once; ``stop`` writes ``finalize`` first, so an unload
or a server stop is never taken for a death. What the guardian then does: ``serving.triton.stub_guardian``.

No thread: the guardian process is the watcher. ``start`` in ``initialize`` (last, once the model works),
``stop`` first in ``finalize``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger(__name__)

FINALIZE = b"finalize\n"


def python_executable() -> str:
    """The interpreter for the guardian: the stub embeds Python, so ``sys.executable`` may name the stub binary;
    the ``python3`` on PATH is the one the stub itself was started with (serve.sh puts the venv first)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


class StubGuard:
    """Starts ``python -m serving.triton.stub_guardian`` for this stub's model, with a pipe only this stub writes."""

    def __init__(self, model_name: str, grpc_url: str, tls: GrpcTls | None = None) -> None:
        """
        Args:
            model_name: the Triton model this stub serves (the guardian checks it is READY).
            grpc_url: ``host:port`` of this tritonserver's gRPC endpoint (``WorkerConfig.grpc_url``).
            tls: TLS of the guardian's channel to it (a server with ``--grpc-use-ssl``); None: plaintext.
        """
        self._model_name = model_name
        self._grpc_url = grpc_url
        self._tls = tls
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StubGuard:
        """Spawn the guardian (its stdin is our pipe; stdout/stderr are the stub's, i.e. the server log).
        Raises OSError when it cannot be started."""
        argv = [python_executable(), "-m", "serving.triton.stub_guardian", "--model", self._model_name,
                "--grpc-url", self._grpc_url, "--server-pid", str(os.getppid()), "--stub-pid", str(os.getpid()),
                "--shm-region", _own_shm_region()]
        if self._tls is not None:
            tls = self._tls
            argv += ["--grpc-ssl-root-cert", tls.root_cert, "--grpc-ssl-client-cert", tls.client_cert,
                     "--grpc-ssl-client-key", tls.client_key, "--grpc-ssl-target-name", tls.target_name]
        # close_fds (the default) keeps the write end out of every other child: only our death closes it
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
        logger.info("%s: stub guardian pid %d", self._model_name, self._proc.pid)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Tell the guardian this stub ends on purpose, and reap it (it exits at once)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(FINALIZE)
            proc.stdin.close()
        except BrokenPipeError:   # it is gone already (a SIGTERM to the whole process group)
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s: stub guardian did not exit; killing it", self._model_name)
            proc.kill()
            proc.wait(timeout_s)


def _own_shm_region() -> str:
    """The python backend's shared-memory region of this stub (its second argument), '' when unknown."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return next((a.decode() for a in args if a.startswith(b"triton_python_backend_shm_region")), "")
