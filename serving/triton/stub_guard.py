"""``StubGuard``: the stub's half of its guardian (``serving.triton.stub_guardian``): it starts the guardian
process first thing in ``initialize``, tells it when the model works (a death from then on is healed) and, in
``finalize``, that this stub ends on purpose.

tritonserver 2.51's python backend never restarts a dead stub of a decoupled model and keeps reporting the
model ready (r24.10 ``src/python_be.cc``: "TODO: Implement restart on decoupled"). Nothing inside the dead
stub can act, and tritonserver does not ask it: the guardian (``serving.triton.stub_guardian``, a small
process of its own) holds the read end of a pipe whose only write end is this stub's. A stub that dies in any
way (``kill -9``, a segfault, the OOM killer) closes it, and the guardian sees end-of-file at once; ``ending``
writes ``finalize`` first, so an unload or a server stop is never taken for a death. The guardian also watches
tritonserver: a server that dies under a running stub (killed while its models load, say) has the stub killed
at once, before python_backend's stub tears itself down under its running threads (a crash). What the guardian
does: ``serving.triton.stub_guardian``.

No thread: the guardian process is the watcher.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from serving.triton.stub_guardian import FINALIZE, ready_line

if TYPE_CHECKING:
    from serving.triton.grpc_tls import GrpcTls

logger = logging.getLogger(__name__)


def python_executable() -> str:
    """The interpreter for the guardian: the stub embeds Python, so ``sys.executable`` may name the stub
    binary; the ``python3`` on PATH is the one the stub itself was started with (serve.sh puts the venv
    first)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


class StubGuard:
    """Starts ``python -m serving.triton.stub_guardian`` for this stub's model, with a pipe only this stub
    writes.

    ``start`` first thing in ``initialize`` (the guardian then already watches tritonserver while the model
    loads: a server killed under a loading stub has the stub killed at once instead of crashing);
    ``arm`` once the model works (from then on the stub's death is healed); ``ending`` first in ``finalize``
    (an end on purpose); ``stop`` last in ``finalize``, or after a failed load (the guardian exits and is
    reaped). Any one thread at a time: Triton's model-load thread.
    """

    def __init__(self, model_name: str) -> None:
        """
        Args:
            model_name: the Triton model this stub serves (the guardian checks it is READY before healing).
        """
        self._model_name = model_name
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StubGuard:
        """Spawn the guardian (its stdin is our pipe; stdout/stderr are the stub's, i.e. the server log).
        Raises OSError when it cannot be started."""
        argv = [python_executable(), "-m", "serving.triton.stub_guardian", "--model", self._model_name,
                "--server-pid", str(os.getppid()), "--stub-pid", str(os.getpid()),
                "--shm-region", _own_shm_region()]
        # close_fds (the default) keeps the write end out of every other child: only our death closes it
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
        logger.info("%s: stub guardian pid %d", self._model_name, self._proc.pid)
        return self

    def arm(self, grpc_url: str, tls: GrpcTls | None = None, drain_timeout_s: float = 30.0) -> None:
        """The model works: a death of this stub from now on gets its server replaced. ``grpc_url``: this
        tritonserver's gRPC endpoint (``host:port``), which the guardian asks for health, over ``tls`` (a
        server with ``--grpc-use-ssl``; None: plaintext); ``drain_timeout_s``: how long the server's other
        models may drain once the guardian ended it, seconds."""
        self._write(ready_line(grpc_url, tls, drain_timeout_s))

    def ending(self) -> None:
        """This stub ends on purpose (an unload, a server stop): no death to heal. The guardian still kills
        the stub should tritonserver die before it ends (its exit timeout expiring under a long drain)."""
        self._write(FINALIZE)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the pipe and reap the guardian (it exits at once). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.close()
        except BrokenPipeError:   # it is gone already
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s: stub guardian did not exit; killing it", self._model_name)
            proc.kill()
            proc.wait(timeout_s)

    def _write(self, line: bytes) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except BrokenPipeError:
            logger.warning("%s: stub guardian (pid %d) is gone", self._model_name, self._proc.pid)


def _own_shm_region() -> str:
    """The python backend's shared-memory region of this stub (its second argument), '' when unknown."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return next((a.decode() for a in args if a.startswith(b"triton_python_backend_shm_region")), "")
