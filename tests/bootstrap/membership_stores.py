"""Real membership stores for the membership tests, on free loopback ports: the registry as its own process
(``python -m bootstrap.membership``) and etcd (the ``etcd`` binary, a temp data dir; optionally TLS with
client certificates, ``EtcdCerts``), each killable with SIGKILL and restartable on the same port (the registry
empty, etcd on its data dir). Run as a script it is a
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
from dataclasses import dataclass
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
ETCD = shutil.which("etcd")
ETCDCTL = shutil.which("etcdctl")
OPENSSL = shutil.which("openssl")
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


@dataclass(frozen=True)
class EtcdCerts:
    """PEM files for etcd over TLS with client certificates: a CA, the server's certificate (``serverAuth``
    and ``clientAuth``: etcd 3.4's JSON gateway dials etcd's gRPC with it) and a client's (no common name)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, directory: Path) -> EtcdCerts:
        """A throwaway CA (ECDSA P-256, 2 days) and both certificates, for 127.0.0.1/localhost."""
        assert OPENSSL is not None, "the openssl command is not installed"
        directory.mkdir(parents=True, exist_ok=True)
        ca, ca_key = directory / "etcd-ca.pem", directory / "etcd-ca.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=etcd test ca",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        server = _signed_cert(directory, "etcd-server", (ca, ca_key), "serverAuth,clientAuth", "/CN=etcd")
        # No common name: with auth enabled, etcd's gateway answers 400 to a client certificate that has one.
        client = _signed_cert(directory, "etcd-client", (ca, ca_key), "clientAuth", "/O=triton-pd fleet")
        return cls(ca, *server, *client)


def _openssl(*args: str) -> None:
    subprocess.run([OPENSSL or "openssl", *args], check=True, capture_output=True, timeout=60)


def _signed_cert(directory: Path, name: str, ca: tuple[Path, Path], usage: str, subject: str
                 ) -> tuple[Path, Path]:
    cert, key, csr, ext = (directory / f"{name}.{suffix}" for suffix in ("pem", "key", "csr", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
                   f"keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             str(key), "-out", str(csr), "-subj", subject)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


class EtcdProcess(_Process):
    """One etcd member on free loopback ports with its data in ``workdir``; ``start`` again after ``kill``
    reopens the same data dir. ``certs``: serve the client port over TLS and require a client certificate
    signed by its CA (``--cert-file/--key-file/--trusted-ca-file/--client-cert-auth``)."""

    def __init__(self, workdir: Path, certs: EtcdCerts | None = None) -> None:
        super().__init__()
        self.port, self._peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.url = "etcd://" + self.endpoint
        self._workdir = workdir
        self.certs = certs
        self._scheme = "http" if certs is None else "https"

    def start(self) -> None:
        assert ETCD is not None, NO_ETCD
        client, peer = f"{self._scheme}://{self.endpoint}", f"http://127.0.0.1:{self._peer_port}"
        tls = [] if self.certs is None else [
            "--cert-file", str(self.certs.server_cert), "--key-file", str(self.certs.server_key),
            "--trusted-ca-file", str(self.certs.ca), "--client-cert-auth"]
        self._spawn([ETCD, "--name", "t", "--data-dir", str(self._workdir / "etcd-data"),
                     "--listen-client-urls", client, "--advertise-client-urls", client,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", f"t={peer}", "--log-level", "warn", *tls], child_env(),
                    self._workdir / "etcd.log")
        wait_until(self._healthy, 20.0, f"etcd on {self.endpoint} healthy")

    def _healthy(self) -> bool:
        verify: bool | str = True if self.certs is None else str(self.certs.ca)
        cert = None if self.certs is None else (str(self.certs.client_cert), str(self.certs.client_key))
        try:
            answer = requests.get(f"{self._scheme}://{self.endpoint}/health", timeout=0.5, verify=verify,
                                  cert=cert)
            return answer.json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    def etcdctl(self, *args: str, user: str = "") -> str:
        assert ETCDCTL is not None, NO_ETCD
        tls = [] if self.certs is None else [f"--cacert={self.certs.ca}", f"--cert={self.certs.client_cert}",
                                             f"--key={self.certs.client_key}"]
        argv = [ETCDCTL, f"--endpoints={self._scheme}://{self.endpoint}", *tls,
                *([f"--user={user}"] if user else []), *args]
        done = subprocess.run(argv, env=child_env({"ETCDCTL_API": "3"}), capture_output=True,
                              text=True, timeout=30,
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
    membership = make_membership(url, load_fleet_secret(os.environ), dict(os.environ))
    assert membership is not None
    membership.announce(Member(instance_id, role, "127.0.0.1:1", "m", "http://127.0.0.1:2", time.time_ns()),
                        float(ttl_s))
    membership.start()
    signal.sigwait({signal.SIGTERM})
    membership.stop()


if __name__ == "__main__":
    _worker_main(*sys.argv[1:5])
