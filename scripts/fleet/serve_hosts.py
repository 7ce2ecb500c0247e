"""Whole servers across network hosts: one ``scripts/serve.sh`` per host of a ``scripts/fleet`` fleet, each
started as the README's "Across servers" commands say.

Hosts: ``reg`` (``ROLE=registry``) and, by default, ``rt`` (``ROLE=router``), ``pf`` (``ROLE=prefill``),
``dc`` (``ROLE=decode``); ``HostFleet(roles=...)`` names other worker hosts (``XPYD_2P2D``: two of each).
Every server gets ``HOST=0.0.0.0``, ``ADVERTISE_HOST=<its address>``, ``PD_REGISTRY_URL=http://<reg>:8998``, a
fleet secret file (it binds a non-loopback address) and ``PD_KV_NETWORK_ONLY=1`` (the hosts share one kernel:
docs/multihost.md), on the README's default ports (each host has its own port space), and none of this
process's ``UCX_*``/``MC_*`` variables (a test's in-process NIXL agent leaves ``UCX_NET_DEVICES=lo`` there):
a run gives the hosts transport settings in ``HostFleet(env=...)``. The test process reaches
each server through a ``fleet.relay.Relay`` in the server's own host (``ServeScript``'s ``http_url``,
``grpc_url``, ``metrics_url`` are the relays' loopback ports): client traffic never crosses a host's link, so
the links carry only what the servers send each other (KV, gRPC between router and workers, registry traffic).

``HostFleet.start`` makes the namespaces, starts the registry, then the tritonservers at once, and waits
until the router's ``pd_router_ready`` is 1; ``stop`` stops the servers (SIGTERM, SIGKILL after a grace), then
closes the relays and removes the namespaces. ``stop`` is idempotent and runs whatever failed before it.

Used by the live tests across hosts (``tests/fleet/``) and, through ``HostsServer``, by
``scripts/bench_serving.py --models pd_hosts``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

SCRIPTS_DIR = Path(__file__).resolve().parents[1]
if str(SCRIPTS_DIR) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DIR))

from perf.server import (  # noqa: E402
    Deployment,
    ServeScript,
    build_model_repository,
    pin_process,
    wait_http_ok,
    wait_router_ready,
)

from fleet.netns import TRANSPORT_ENV_PREFIXES, Fleet, Host, project_env, unavailable_reason  # noqa: E402
from fleet.relay import Relay  # noqa: E402

SERVE_SH = str(Path(__file__).resolve().parents[2] / "scripts" / "serve.sh")
HTTP_PORT, GRPC_PORT, METRICS_PORT, REGISTRY_PORT = 8000, 8001, 8002, 8998   # serve.sh's defaults
ROLES = {"rt": "router", "pf": "prefill", "dc": "decode"}
#: two prefill hosts and two decode hosts behind the router
XPYD_2P2D = {"rt": "router", "pf": "prefill", "pf2": "prefill", "dc": "decode", "dc2": "decode"}
MODEL_OF_ROLE = {"router": "pd_ensemble", "prefill": "prefill", "decode": "decode"}
SECRET = "hosts-fleet-test-secret"
STOP_S = 40.0


class HostFleet:
    """The hosts and their servers. Attributes after ``start``: ``fleet`` (the ``Fleet``), ``servers``
    (host name → ``ServeScript`` for every host but ``reg``), ``registry_url`` (as the servers reach it)."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None,
                 roles: dict[str, str] | None = None) -> None:
        """``env``: extra environment of every server (e.g. ``UCX_*`` for a run). ``roles``: host name → role
        (``router``, ``prefill``, ``decode``) of the hosts beside ``reg``; one router host, named ``rt``
        (default ``ROLES``)."""
        self.tmp = tmp
        self.roles = dict(roles or ROLES)
        if [h for h, r in self.roles.items() if r == "router"] != ["rt"]:
            raise ValueError(f"one router host, named rt: {self.roles}")
        self.fleet = Fleet(["reg", *self.roles])
        self.servers: dict[str, ServeScript] = {}
        self.relays: list[Relay] = []
        self.registry_url = ""
        # host -> (seconds its stop took, whether SIGKILL was needed)
        self.stops: dict[str, tuple[float, bool]] = {}
        self._extra = env or {}
        self._registry_log: IO[bytes] | None = None

    def host(self, name: str) -> Host:
        return self.fleet[name]

    def relay(self, name: str, port: int, address: str = "") -> Relay:
        """A started relay to ``port`` of host ``name``, at ``address`` as seen from inside it (default: the
        host's own address; ``127.0.0.1`` for what a server binds on loopback only, its metrics)."""
        host = self.fleet[name]
        relay = Relay(host.netns, address or host.address, port).start()
        self.relays.append(relay)
        return relay

    def _env(self, name: str, secret_file: Path) -> dict[str, str]:
        host = self.fleet[name]
        return {"HOST": "0.0.0.0", "ADVERTISE_HOST": host.address, "ROLE": self.roles.get(name, "registry"),
                "PD_REGISTRY_URL": self.registry_url, "PD_FLEET_SECRET_FILE": str(secret_file),
                "PD_KV_NETWORK_ONLY": "1", "MODELS": "",   # the role's default models, as the README runs it
                "HTTP_PORT": str(HTTP_PORT), "GRPC_PORT": str(GRPC_PORT), "METRICS_PORT": str(METRICS_PORT),
                "REGISTRY_PORT": str(REGISTRY_PORT), "SKIP_SETUP": "1", "OPENAI": "0", **self._extra}

    def serve_script(self, name: str, secret_file: Path) -> ServeScript:
        """The ``ServeScript`` of host ``name``'s server (not started; its URLs still local): the README's
        "Across servers" variables over ``project_env()``, so this process's own transport settings (a test's
        in-process NIXL agent sets ``UCX_NET_DEVICES=lo``) never reach a host."""
        return ServeScript(MODEL_OF_ROLE[self.roles[name]], self.tmp / f"{name}.log",
                           env=self._env(name, secret_file),
                           ports=(HTTP_PORT, GRPC_PORT, METRICS_PORT, REGISTRY_PORT),
                           launcher=["ip", "netns", "exec", self.fleet[name].netns], base_env=project_env())

    def start(self, ready_timeout_s: float) -> HostFleet:
        """Makes the hosts and starts every server; raises (RuntimeError, TimeoutError, CalledProcessError)
        with the failing server's log tail when one does not come up. The caller runs ``stop`` in any case."""
        self.fleet.create()
        secret_file = self.tmp / "fleet-secret"
        secret_file.write_text(SECRET + "\n")
        secret_file.chmod(0o600)
        reg = self.fleet["reg"]
        self.registry_url = f"http://{reg.address}:{REGISTRY_PORT}"
        self._registry_log = open(self.tmp / "reg.log", "wb")  # noqa: SIM115 (closed by stop)
        proc = reg.popen([SERVE_SH], env=self._env("reg", secret_file), stdout=self._registry_log,
                         stderr=subprocess.STDOUT)
        self._wait_registry(proc, ready_timeout_s)
        for name in self.roles:
            server = self.serve_script(name, secret_file)
            server.http_url = f"http://{self.relay(name, HTTP_PORT).hostport}"
            server.grpc_url = self.relay(name, GRPC_PORT).hostport
            # serve.sh binds metrics to loopback (METRICS_HOST): read inside the host, as a local agent would
            server.metrics_url = f"http://{self.relay(name, METRICS_PORT, '127.0.0.1').hostport}/metrics"
            self.servers[name] = server
        with ThreadPoolExecutor(len(self.servers)) as pool:   # ~20 s of start each: at once
            for done in [pool.submit(s.start, ready_timeout_s) for s in self.servers.values()]:
                done.result()
        router = self.servers["rt"]
        assert router._proc is not None
        wait_router_ready(router.metrics_url, router._proc, ready_timeout_s)
        return self

    def _wait_registry(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        wait_http_ok(f"http://{self.relay('reg', REGISTRY_PORT).hostport}/health", proc, timeout_s,
                     lambda: f"the registry exited:\n{(self.tmp / 'reg.log').read_text()[-3000:]}",
                     lambda: f"the registry did not answer within {timeout_s:.0f} s", poll_s=0.2)

    def stop(self) -> None:
        """Servers (router first, then workers; ``stops`` says how each went), relays, then the namespaces
        (which kills the registry and any straggler). Idempotent; never raises."""
        for name in self.roles:   # the router first
            server = self.servers.get(name)
            if server is not None:
                try:
                    self.stops[name] = server.stop(STOP_S)
                except Exception:   # noqa: BLE001 - teardown goes on whatever one server did
                    pass
        for relay in self.relays:
            relay.close()
        self.relays.clear()
        self.fleet.teardown()
        if self._registry_log is not None:
            self._registry_log.close()
            self._registry_log = None


class HostEndpoints:
    """Where a benchmark reaches a ``HostFleet`` (the ``ServerPorts`` attributes ``perf.bench_run`` reads):
    the router's gRPC (``host:port`` of its relay) and the prefill host's metrics URL (the KV transfer
    counters)."""

    def __init__(self, grpc_url: str, metrics_url: str) -> None:
        self.grpc_url = grpc_url
        self.metrics_url = metrics_url

    def __repr__(self) -> str:
        return f"HostEndpoints(grpc={self.grpc_url}, prefill metrics={self.metrics_url})"


class HostsServer:
    """``perf.server.RunningServer``'s interface over a ``HostFleet`` (router, prefill and decode each on its
    own network host, plus the registry's): what ``scripts/bench_serving.py --models pd_hosts`` runs. The
    deployment's model configs (its overrides) become the fleet's ``MODEL_REPOSITORY``; the stubs of each
    worker host are pinned to ``deployment.cpus[role]`` as the one-host run pins them; the ``UCX_*``/``MC_*``
    variables of the shell that started the benchmark reach every server (an operator's settings, as on one
    host). Needs root (network namespaces).
    """

    def __init__(self, deployment: Deployment, log_dir: Path, ready_timeout_s: float = 300.0) -> None:
        self.deployment = deployment
        self.ports = HostEndpoints("", "")
        self.pinned: dict[str, list[int]] = {}
        self._log_dir = log_dir
        self._ready_timeout_s = ready_timeout_s
        self._fleet: HostFleet | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> HostsServer:
        """Raises RuntimeError (no namespaces here, or a server exited) or TimeoutError (not ready in
        time)."""
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"{self.deployment.name}: {reason}")
        self._tmp = tempfile.TemporaryDirectory(prefix=f"bench-{self.deployment.name}-")
        repo = build_model_repository(self.deployment, Path(self._tmp.name) / "models")
        logs = self._log_dir / f"hosts-{self.deployment.name}"
        logs.mkdir(parents=True, exist_ok=True)
        transport = {k: v for k, v in os.environ.items() if k.startswith(TRANSPORT_ENV_PREFIXES)}
        self._fleet = HostFleet(logs, env={"MODEL_REPOSITORY": str(repo), **transport})
        self._fleet.start(self._ready_timeout_s)
        servers = self._fleet.servers
        self.ports = HostEndpoints(servers["rt"].grpc_url, servers["pf"].metrics_url)
        for host, role in self._fleet.roles.items():
            cpus = self.deployment.cpus.get(role)
            for pid in servers[host].stub_pids() if cpus else []:
                pin_process(pid, cpus)
                self.pinned.setdefault(role, []).extend(sorted(os.sched_getaffinity(pid)))
        return self

    def check_alive(self, during: str) -> None:
        """Raise RuntimeError when a server of the fleet has exited."""
        assert self._fleet is not None
        for host, server in self._fleet.servers.items():
            proc = server._proc
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"{self.deployment.name}: the server on host {host} exited during "
                                   f"{during} (logs in {self._log_dir})")

    def stop(self) -> None:
        if self._fleet is not None:
            self._fleet.stop()
            self._fleet = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> HostsServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
