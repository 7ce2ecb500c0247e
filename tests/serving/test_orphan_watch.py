"""``serving.triton.orphan_watch``: ``stop`` ends and joins the watch thread at once (``finalize`` leaves no
thread that runs Python while the stub tears down); a stub whose parent (tritonserver) is gone ends itself."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from serving.triton.orphan_watch import OrphanWatch


def test_stop_joins_the_thread_without_waiting_out_the_interval() -> None:
    watch = OrphanWatch("t0", interval_s=30.0).start()
    assert any(t.name == "orphan-watch-t0" for t in threading.enumerate())
    start_s = time.monotonic()
    watch.stop(timeout_s=5.0)
    assert time.monotonic() - start_s < 2.0
    assert not any(t.name == "orphan-watch-t0" for t in threading.enumerate())
    watch.stop()   # idempotent


# A supervisor (a child subreaper, so the orphaned stub becomes its child and can be waited on) starts a
# parent, which starts the stub; the supervisor kills the parent and reports how the stub ended and how long
# it took.
_SUPERVISOR = r"""
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
stub = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
        "from serving.triton.orphan_watch import OrphanWatch; "
        "OrphanWatch('stub', interval_s=0.05).start(); print('ready', flush=True); time.sleep(20)")
parent = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
    "print(p.pid, flush=True); time.sleep(60)", stub, sys.argv[1]], stdout=subprocess.PIPE, text=True)
stub_pid = int(parent.stdout.readline())
# 'ready': the stub's watch runs (its stdout is the parent's)
print(parent.stdout.readline().strip(), flush=True)
parent.kill()
parent.wait()
killed_s = time.monotonic()
pid, status = os.waitpid(stub_pid, 0)   # the stub is ours now (subreaper)
print("exit", os.waitstatus_to_exitcode(status), round(time.monotonic() - killed_s, 3), flush=True)
"""


def test_a_stub_whose_parent_is_gone_exits_on_its_own() -> None:
    """The watch ends its process (exit status 1) soon after the parent dies, without being told; the watch
    interval bounds how long that takes."""
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", _SUPERVISOR, root], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert "ready" in lines, proc.stdout
    exit_index = lines.index("exit")
    code, after_s = int(lines[exit_index + 1]), float(lines[exit_index + 2])
    assert code == 1, proc.stdout   # os._exit(1) from the watch, not the stub's own 20 s sleep ending (0)
    assert after_s < 10.0
    assert "is gone; exiting" in proc.stderr
