"""``perf.server.catches_signal``: which stubs a slow stop may ask for a stack dump (SIGUSR1 kills a process
that has no handler for it)."""

from __future__ import annotations

import signal
import subprocess
import sys

from perf.server import catches_signal


def test_catches_signal_tells_a_process_with_a_sigusr1_handler_from_one_without() -> None:
    handled = subprocess.Popen([sys.executable, "-c", "import faulthandler, signal, sys, time; "
                                "faulthandler.register(signal.SIGUSR1); print(flush=True); time.sleep(30)"],
                               stdout=subprocess.PIPE)
    plain = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        for proc in (handled, plain):
            assert proc.stdout is not None and proc.stdout.readline() == b"\n"   # up, handler installed
        assert catches_signal(handled.pid, signal.SIGUSR1)
        assert not catches_signal(plain.pid, signal.SIGUSR1)
    finally:
        for proc in (handled, plain):
            proc.kill()
            proc.wait()
    assert not catches_signal(handled.pid, signal.SIGUSR1)   # gone
