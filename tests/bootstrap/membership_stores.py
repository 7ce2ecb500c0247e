"""Real membership stores for the membership tests, on free loopback ports: the registry as its own process
(``python -m bootstrap.membership``) and etcd (the ``etcd`` binary, a temp data dir), each killable with
SIGKILL and restartable on the same port (the registry empty, etcd on its data dir). Run as a script it is a
worker process that announces one member until killed:
``python membership_stores.py <membership url> <instance_id> <role> <ttl_s>`` (fleet secret from the env).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
ETCD = shutil.which("etcd")
ETCDCTL = shutil.which("etcdctl")
NO_ETCD = ("the etcd or etcdctl binary is not installed (scripts/setup.sh installs Debian's etcd-server and "
           "etcd-client as root)")


def free_port() -> int:
    """One port for a process started later (``perf.server.free_ports``: outside the ephemeral range)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    from perf.server import free_ports

    return free_ports(1)[0]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Polls ``predicate`` every 50 ms; returns the seconds it took, fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class _Process:
    """A child process in its own session, killed with SIGKILL by ``kill`` and at ``close``."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        self.proc = None


class RegistryProcess(_Process):
    """``python -m bootstrap.membership`` on a fixed free port; ``start`` again after ``kill``: empty."""

    def __init__(self, workdir: Path, secret: bytes | None = None) -> None:
        super().__init__()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._workdir, self._secret = workdir, secret

    def start(self) -> None:
        env = child_env({"PD_FLEET_SECRET": self._secret.decode()} if self._secret else None)
        self._spawn([sys.executable, "-m", "bootstrap.membership", "--port", str(self.port)], env,
                    self._workdir / "registry.log")
        wait_until(self._healthy, 20.0, f"registry on {self.url} healthy")

    def _healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=0.5).status_code == 200
        except requests.RequestException:
            return False


class EtcdProcess(_Process):
    """One etcd member on free loopback ports with its data in ``workdir``; ``start`` again after ``kill``
    reopens the same data dir."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.port, self._peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.url = "etcd://" + self.endpoint
        self._workdir = workdir

    def start(self) -> None:
        assert ETCD is not None, NO_ETCD
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self._peer_port}"
        self._spawn([ETCD, "--name", "t", "--data-dir", str(self._workdir / "etcd-data"),
                     "--listen-client-urls", client, "--advertise-client-urls", client,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", f"t={peer}", "--log-level", "warn"], child_env(),
                    self._workdir / "etcd.log")
        wait_until(self._healthy, 20.0, f"etcd on {self.endpoint} healthy")

    def _healthy(self) -> bool:
        try:
            return requests.get(f"http://{self.endpoint}/health", timeout=0.5).json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    def etcdctl(self, *args: str, user: str = "") -> str:
        assert ETCDCTL is not None, NO_ETCD
        argv = [ETCDCTL, f"--endpoints=http://{self.endpoint}", *([f"--user={user}"] if user else []), *args]
        done = subprocess.run(argv, env=child_env({"ETCDCTL_API": "3"}), capture_output=True, text=True, timeout=30,
                              check=False)
        assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr}"
        return done.stdout


class WorkerProcess(_Process):
    """A process that announces one member through ``url`` until killed."""

    def start(self, url: str, instance_id: str, role: str, ttl_s: float, workdir: Path,
              secret: bytes | None = None) -> None:
        env = child_env({"PD_FLEET_SECRET": secret.decode()} if secret else None)
        self._spawn([sys.executable, __file__, url, instance_id, role, str(ttl_s)], env,
                    workdir / f"worker-{instance_id.replace('/', '_')}.log")


def _worker_main(url: str, instance_id: str, role: str, ttl_s: str) -> None:
    import logging

    from bootstrap.auth import load_fleet_secret
    from bootstrap.membership import Member, make_membership

    logging.basicConfig(level=logging.INFO)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # before any thread: sigwait takes it
    membership = make_membership(url, load_fleet_secret())
    assert membership is not None
    membership.announce(Member(instance_id, role, "127.0.0.1:1", "m", "http://127.0.0.1:2", time.time_ns()),
                        float(ttl_s))
    membership.start()
    signal.sigwait({signal.SIGTERM})
    membership.stop()


if __name__ == "__main__":
    _worker_main(*sys.argv[1:5])
