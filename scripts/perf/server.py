"""Start and stop a private tritonserver (and the bootstrap service) for a benchmark, pin model stubs to
cores.

The server is what ``scripts/serve.sh`` runs (tritonserver 2.51 of ``nvidia-pytriton`` + the bootstrap
service), started directly, on loopback ports chosen by the caller, from a temporary model repository holding
the chosen models of ``model_repository/`` (their ``1/`` folders linked, ``config.pbtxt`` copied with
parameter overrides). Pinning uses ``sched_setaffinity`` on every thread of a model's stub process
(``/proc/<pid>/task``), so it works whatever the model does itself.

``ServeScript`` runs ``scripts/serve.sh`` itself instead (the README's command, set-up skipped) on free ports:
the live tests' ``triton_server`` fixture and the serving benchmarks use it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# python backend stubs name their regions on the command line
SHM_PREFIX = "triton_python_backend_shm_region_"


@dataclass(frozen=True)
class ServerPorts:
    """Loopback ports of one tritonserver."""

    http: int
    grpc: int
    metrics: int

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"


@dataclass(frozen=True)
class Deployment:
    """What one server runs.

    Attributes:
        name: ``"pd"`` or ``"colo"`` (keys of the result JSON).
        entry_model: the model clients call (``pd_ensemble`` or ``colocated``).
        models: every model to load.
        overrides: model → {parameter key → string value} written into its ``config.pbtxt``.
        cpus: model → CPU ids its stub process is pinned to after loading (absent: not pinned).
        copies: model → the ``model_repository/`` model it is a renamed copy of (e.g. a second router with
            other parameters beside ``pd_ensemble``); absent: the model's own folder.
    """

    name: str
    entry_model: str
    models: tuple[str, ...]
    overrides: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    cpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    copies: Mapping[str, str] = field(default_factory=dict)


def tritonserver_paths() -> tuple[Path, Path]:
    """(tritonserver binary, backends dir) of the installed nvidia-pytriton; copies the python backend stub
    for this interpreter into place when it is missing (see docs/FINDINGS)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed (scripts/setup.sh)")
    base = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    backends = base / "backends"
    stub = backends / "python" / "triton_python_backend_stub"
    if not stub.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        shutil.copy2(base / "python_backend_stubs" / version / "triton_python_backend_stub", stub)
    return base / "bin" / "tritonserver", backends


def _override_parameters(config: str, overrides: Mapping[str, str]) -> str:
    for key, value in overrides.items():
        pattern = re.compile(
            r'(\{\s*key:\s*"' + re.escape(key) + r'",\s*value:\s*\{\s*string_value:\s*)"[^"]*"')
        if pattern.search(config):
            config = pattern.sub(lambda m, v=value: f'{m.group(1)}"{v}"', config)  # type: ignore[misc]
        else:  # serving/config.py rejects unknown keys: pass only WorkerConfig fields
            config += f'\nparameters {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'

    return config


def build_model_repository(deployment: Deployment, dest: Path) -> Path:
    """Write ``dest`` with the deployment's models (``1/`` linked to the repo, config with overrides)."""
    for model in deployment.models:
        source = deployment.copies.get(model, model)
        src = REPO_ROOT / "model_repository" / source
        if not (src / "config.pbtxt").is_file():
            raise FileNotFoundError(f"model_repository/{source}/config.pbtxt is missing")
        (dest / model).mkdir(parents=True)
        (dest / model / "1").symlink_to(src / "1", target_is_directory=True)
        config = _override_parameters((src / "config.pbtxt").read_text(), deployment.overrides.get(model, {}))
        if source != model:
            config = config.replace(f'name: "{source}"', f'name: "{model}"', 1)
        (dest / model / "config.pbtxt").write_text(complete_config(config, source))
    return dest


def complete_config(config: str, role: str) -> str:
    """``config`` (a ``config.pbtxt``'s text, of a model of ``role``) with the outputs and ``return_*`` inputs
    of ``serving.schema`` appended (``config_pbtxt``), as its model.py's auto-complete would declare them: a
    repository of complete configs starts without tritonserver's auto-complete stage
    (``--disable-auto-complete-config``: ``server_command`` and serve.sh pass it for such a repository), about
    1.3 s less per model load on a quiet host. A config that declares outputs already is left as it is."""
    from serving.schema import config_pbtxt

    if re.search(r"^output\s*\[", config, re.MULTILINE):
        return config
    return config.rstrip("\n") + "\n\n# serving/schema.py's declarations (scripts/perf/server.py)\n" \
        + config_pbtxt(role)


_ROLE_OF_MODEL_PY = re.compile(r'deferred_model\(\s*"[\w.]+",\s*"\w+",\s*"(\w+)"')


def complete_repository(repo: Path) -> Path:
    """Completes, in place, every ``config.pbtxt`` of ``repo`` (a repository a test or benchmark wrote, e.g. a
    copy of ``model_repository/``) that lacks its outputs (``complete_config``; the role read from the model's
    ``1/model.py``, whose ``deferred_model`` names it); returns ``repo``. A model whose model.py names no role
    is left as it is."""
    for config_path in sorted(repo.glob("*/config.pbtxt")):
        model_py = config_path.parent / "1" / "model.py"
        match = _ROLE_OF_MODEL_PY.search(model_py.read_text()) if model_py.is_file() else None
        if match is not None:
            text = config_path.read_text()
            completed = complete_config(text, match.group(1))
            if completed != text:
                config_path.write_text(completed)
    return repo


def repository_is_complete(repo: Path) -> bool:
    """Every model of ``repo`` declares an ``output`` list in its ``config.pbtxt`` (what ``complete_config``
    writes): tritonserver's auto-complete stage can be skipped. serve.sh makes the same check."""
    configs = [d / "config.pbtxt" for d in repo.iterdir() if (d / "config.pbtxt").is_file()]
    return bool(configs) and all(re.search(r"^output\s*\[", c.read_text(), re.MULTILINE) for c in configs)


def pd_model_repository(dest: Path, kv_backend: str) -> Path:
    """``dest`` with the PD models (``pd_ensemble``, ``prefill``, ``decode``) of ``model_repository/``,
    prefill's and decode's ``kv_backend`` set to ``kv_backend`` (``nixl``, ``mooncake``, ...); configuration
    only."""
    backend = {"kv_backend": kv_backend}
    build_model_repository(Deployment(name="pd", entry_model="pd_ensemble",
                                      models=("pd_ensemble", "prefill", "decode"),
                                      overrides={"prefill": backend, "decode": backend}), dest)
    for role in ("prefill", "decode"):   # the one kv_backend entry rewritten, not a second one appended
        config = (dest / role / "config.pbtxt").read_text()
        if config.count('key: "kv_backend"') != 1 or f'string_value: "{kv_backend}"' not in config:
            raise ValueError(f"{role}/config.pbtxt: kv_backend not set to {kv_backend!r} in place")
    return dest


# what a dying process leaves in the server log: faulthandler, libstdc++, glibc, UCX's handler, python_backend
_CRASH = re.compile(r"Fatal Python error|terminate called|Segmentation fault|Aborted|Caught signal|"
                    r"corrupted|double free|fastbin|lock_exception|is not healthy|Killed|MemoryError")
_CRASH_CONTEXT_LINES = 25   # a faulthandler report: the error, then each thread's stack


def log_excerpt(text: str, num_chars: int) -> str:
    """``text``'s last ``num_chars`` characters; when a crash report (``_CRASH``) lies before them, up to 200
    of its lines (each hit with the ``_CRASH_CONTEXT_LINES`` after it) come first: a stub that died while the
    others kept logging would otherwise be cut off a failed start's message."""
    head, tail = text[:-num_chars], text[-num_chars:]
    lines = head.splitlines()
    keep: list[int] = []
    for i, line in enumerate(lines):
        if _CRASH.search(line):
            keep.extend(range(max(i, keep[-1] + 1 if keep else 0), min(len(lines), i + _CRASH_CONTEXT_LINES)))
    if not keep:
        return tail
    report = "\n".join(lines[i] for i in keep[:200])
    return f"[crash report earlier in the log]\n{report}\n[log tail]\n{tail}"


def host_state() -> str:
    """One line on what this host has left when a server fails to start: available memory, /dev/shm in use,
    load average, and how many tritonserver and python-backend stub processes are running (a leftover of an
    earlier server would show here)."""
    meminfo = dict(line.split(":", 1)
                   for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    servers = stubs = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                comm = (proc / "comm").read_text().strip()
            except OSError:
                continue
            servers += comm == "tritonserver"
            stubs += comm.startswith("triton_python_b")
    shm_text = f"{shm.used / 2**20:.0f} MiB of {shm.total / 2**30:.1f} GiB" if shm else "none"
    return (f"[host] MemAvailable {meminfo.get('MemAvailable', '?').strip()}, /dev/shm {shm_text}, load "
            f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}, {servers} tritonserver and {stubs} "
            f"stub processes running")


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], timeout_s: float, exited: Callable[[], str],
                 timed_out: Callable[[], str], poll_s: float = 0.5) -> None:
    """Polls ``url`` every ``poll_s`` until it answers 200. Raises RuntimeError(``exited()``) when ``proc``
    exits first, TimeoutError(``timed_out()``) when ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(exited())
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(timed_out())


def wait_ready(http_url: str, proc: subprocess.Popen[bytes], timeout_s: float,
               log_tail: Callable[[], str] = lambda: "") -> None:
    """Polls ``<http_url>/v2/health/ready`` until 200. Raises RuntimeError when ``proc`` exits first,
    TimeoutError when ``timeout_s`` passes; both messages end with ``log_tail()``."""
    name = Path(str(proc.args[0] if isinstance(proc.args, list) else proc.args)).name
    wait_http_ok(f"{http_url}/v2/health/ready", proc, timeout_s,
                 lambda: f"{name} exited with {proc.returncode} while loading ({host_state()}):\n"
                         f"{log_tail()}",
                 lambda: f"tritonserver not ready within {timeout_s:.0f} s ({host_state()}):\n{log_tail()}")


def routers_ready(metrics_text: str, routers: Collection[str]) -> bool:
    """Whether every router model in ``routers`` reports ``pd_router_ready`` 1 in ``metrics_text`` (Triton's
    ``/metrics``: one series per router model, label ``model``)."""
    ready = {line.split('model="', 1)[1].split('"', 1)[0] for line in metrics_text.splitlines()
             if line.startswith("pd_router_ready{") and 'model="' in line and line.rstrip().endswith(" 1")}
    return set(routers) <= ready


def healthy_instances(metrics_url: str) -> tuple[int, int]:
    """(prefill, decode) instances the router whose metrics are at ``metrics_url`` lists healthy
    (``pd_router_healthy_instances``); (0, 0) while it does not answer."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return 0, 0
    counts = {"prefill": 0, "decode": 0}
    for line in text.splitlines():
        if line.startswith("pd_router_healthy_instances{") and line.rstrip().endswith(" 1"):
            for role in counts:
                counts[role] += f'role="{role}"' in line
    return counts["prefill"], counts["decode"]


def wait_router_ready(metrics_url: str, proc: subprocess.Popen[bytes], timeout_s: float,
                      routers: Collection[str] = ("pd_ensemble",)) -> None:
    """Polls the ``pd_router_ready`` gauge until each of ``routers`` (router model names) reads 1 (a prefill
    and a decode instance in its fleet: Triton's readiness says only that the models loaded; a request sent
    before waits up to the router's ``fleet_wait_s``). Raises RuntimeError when ``proc`` exits first,
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before its router was ready")
        try:
            with urllib.request.urlopen(metrics_url, timeout=2) as resp:
                if routers_ready(resp.read().decode(), routers):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"pd_router_ready not 1 for each of {sorted(routers)} within {timeout_s:.0f} s")


def stub_pids(model_dir: Path) -> list[int]:
    """PIDs of the python-backend stubs running ``<model_dir>/1/model.py`` (the path names this run's
    private repository, so other servers on the machine never match)."""
    needle = f"{model_dir}/1/model.py"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmdline and needle in cmdline:
            pids.append(int(entry.name))
    return pids


def pin_process(pid: int, cpus: Sequence[int]) -> int:
    """Set the CPU affinity of every thread of ``pid`` (threads made later inherit it); returns threads
    pinned."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), set(cpus))
            count += 1
        except (ProcessLookupError, PermissionError):
            continue
    return count


def server_command(repo: Path, ports: ServerPorts, fleet_secret: bytes | None = None) -> list[str]:
    """tritonserver on loopback, CPU only, explicit model control (what ``scripts/serve.sh`` runs; started
    directly so that whatever stops serve.sh processes on a shared machine leaves a benchmark alone); with a
    ``fleet_secret``, its admin APIs restricted to the fleet's admin key, as serve.sh does."""
    from serving.triton.admin_access import restricted_api_args

    binary, backends = tritonserver_paths()
    models = [f"--load-model={m.name}" for m in sorted(repo.iterdir()) if m.is_dir()]
    return [str(binary), f"--model-repository={repo}", f"--backend-directory={backends}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
            f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
            # serve.sh's exit timeout: the models' drain (30 s by default) + 15 s
            "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--exit-timeout-secs=45",
            # as serve.sh: a repository of complete configs (complete_config) skips the auto-complete stage
            *(["--disable-auto-complete-config"] if repository_is_complete(repo) else []),
            # the routers' keepalive pings (serve.sh says why)
            "--grpc-keepalive-permit-without-calls=1",
            "--grpc-http2-min-recv-ping-interval-without-data=5000",
            "--grpc-http2-max-ping-strikes=0",
            "--model-control-mode=explicit", *models, "--log-verbose=0", *restricted_api_args(fleet_secret)]


def ucx_defaults() -> dict[str, str]:
    """``kv_transfer.nixl_transport.ucx_defaults`` (read from there: one rule for every launcher)."""
    from kv_transfer.nixl_transport import ucx_defaults as defaults

    return defaults()


def server_env(repo: Path, models: tuple[str, ...], ports: ServerPorts) -> dict[str, str]:
    """Environment of the server, as ``scripts/serve.sh`` sets it: this venv's python first on PATH (the stub
    runs ``python3``), the repo importable, the server's own gRPC endpoint (PD workers say it in their card;
    the router reaches them there) and UCX settings of PD workers."""
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "PD_GRPC_URL": ports.grpc_url,
                **{key: env.get(key, value) for key, value in ucx_defaults().items()}})
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO_ROOT}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO_ROOT)
    return env


class RunningServer:
    """A started server; ``stop()`` ends it. Use as a context manager."""

    def __init__(self, deployment: Deployment, ports: ServerPorts, log_dir: Path,
                 ready_timeout_s: float = 300.0) -> None:
        self.deployment = deployment
        self.ports = ports
        self._log_dir = log_dir
        self._ready_timeout_s = ready_timeout_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.repository: Path | None = None
        self.pinned: dict[str, list[int]] = {}

    def _spawn(self, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self._log_dir / log_name, "wb")  # noqa: SIM115 - the child owns it until it exits
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True)
        self._procs.append(proc)
        return proc

    def start(self) -> RunningServer:
        """Start the server, wait for ready, pin stubs. Raises RuntimeError (the
        server exited) or TimeoutError (not ready in time)."""
        from bootstrap.auth import load_fleet_secret

        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"bench-{self.deployment.name}-")
        repo = self.repository = build_model_repository(self.deployment, Path(self._tmp.name) / "models")
        env = server_env(repo, self.deployment.models, self.ports)
        server = self._spawn(server_command(repo, self.ports, load_fleet_secret(env)), env,
                             f"tritonserver-{self.deployment.name}.log")
        wait_ready(f"http://127.0.0.1:{self.ports.http}", server, self._ready_timeout_s)
        routers = [m for m in self.deployment.models if self.deployment.copies.get(m, m) == "pd_ensemble"]
        if routers:   # each router has found its prefill and decode models
            wait_router_ready(self.ports.metrics_url, server, self._ready_timeout_s, routers)
        for model, cpus in self.deployment.cpus.items():
            for pid in stub_pids(repo / model):
                pin_process(pid, cpus)
                self.pinned.setdefault(model, []).extend(sorted(os.sched_getaffinity(pid)))
        logger.info("%s ready on %s, pinned %s", self.deployment.name, self.ports, self.pinned)
        return self

    def processes(self) -> dict[str, int]:
        """PIDs of the running server: ``{"tritonserver": pid, <model>: its stub's pid, ...}`` (the first stub
        of a model with several instances); {} before ``start``."""
        if self.repository is None or not self._procs:
            return {}
        pids = {"tritonserver": self._procs[0].pid}
        for model in self.deployment.models:
            stubs = stub_pids(self.repository / model)
            if stubs:
                pids[model] = stubs[0]
        return pids

    def check_alive(self, during: str) -> None:
        """Raise RuntimeError when the server has exited: figures after that are not figures."""
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.deployment.name}: server process {proc.pid} exited with "
                                   f"{proc.returncode} during {during} (log in {self._log_dir})")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the server, then bootstrap (reverse start order); SIGKILL what outlives ``timeout_s``."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        self._procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scrape_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Prometheus text of ``url`` → {``name{labels}``: value}; {} when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                values[key] = float(value)
            except ValueError:
                continue
    return values


#: ports this process has handed out (free_ports never gives one twice: a server started late keeps its own)
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of Linux's ``net.ipv4.ip_local_port_range`` (where ``bind(0)`` and outgoing connections
    take ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # the kernel's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, free now, for servers to bind later (tritonserver cannot bind port 0).

    They are drawn at random below the kernel's ephemeral range (``ip_local_port_range``): a port from
    ``bind(0)`` would lie inside it, where any outgoing connection (heartbeats, metric scrapes, gRPC channels)
    or another ``bind(0)`` may take it, or leave it in TIME_WAIT, between the pick and the server's bind,
    minutes later for a server a test starts late; tritonserver then fails to bind and exits. Each port is
    checked by binding it on all interfaces and is never handed out twice by this process. Raises RuntimeError
    when no free port is found in 10 000 draws."""
    low = _ephemeral_low()
    first, last = (max(1024, low - 12000), low - 1) if low > 3072 else (10000, 30000)
    picks: list[int] = []
    for _ in range(10_000):
        port = random.randint(first, last)
        if port in _handed_out or port in picks:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        picks.append(port)
        if len(picks) == n:
            _handed_out.update(picks)
            return picks
    raise RuntimeError(f"no {n} free ports in {first}-{last}")


def shm_regions_of_group(pgid: int) -> set[str]:
    """Shared-memory regions named on the command lines of the processes in group ``pgid`` (the stubs)."""
    regions: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        regions.update(a.decode() for a in args if a.startswith(SHM_PREFIX.encode()))
    return regions


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (``SigCgt`` of ``/proc/<pid>/status``);
    False when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def stub_pids_of_group(pgid: int) -> list[int]:
    """PIDs of the python-backend stubs in process group ``pgid``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (os.getpgid(int(proc.name)) == pgid
                    and b"triton_python_backend_stub" in (proc / "cmdline").read_bytes()):
                pids.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return pids


def kernel_log() -> list[str] | None:
    """The kernel ring buffer (``dmesg``) as lines; None where it cannot be read (no permission, no dmesg)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode(errors="replace").splitlines()


def fault_lines(lines: Sequence[str], pids: Sequence[int]) -> list[str]:
    """Kernel lines reporting a fatal fault (segfault, general protection, trap) of one of ``pids``."""
    if not pids:
        return []
    pattern = re.compile(
        r"\[(" + "|".join(str(p) for p in pids) + r")\]:? .*(segfault|general protection|trap)")
    return [line for line in lines if pattern.search(line)]


#: ServeScripts started and not yet stopped or killed (``started_servers``)
_started: weakref.WeakSet[ServeScript] = weakref.WeakSet()


def started_servers() -> list[ServeScript]:
    """The ServeScripts of this process started and not stopped or killed since, whether or not their serve.sh
    still runs: the test suite's failure report shows each one's log tail (tests/conftest.py)."""
    return list(_started)


class ServeScript:
    """``scripts/serve.sh`` with ``models`` (comma-separated) on free loopback ports, in its own process
    group, its output in ``log_path``; ``model_repository`` replaces ``model_repository/`` when given.

    Attributes: ``http_url``, ``metrics_url``, ``registry_url`` (``http://...``: where ``ROLE=registry``
    listens), ``grpc_url`` (``host:port``,
    for tritonclient.grpc), ``log_path``."""

    def __init__(self, models: str, log_path: Path, model_repository: Path | None = None,
                 env: Mapping[str, str] | None = None, ports: Sequence[int] | None = None,
                 launcher: Sequence[str] = (), base_env: Mapping[str, str] | None = None,
                 in_place: bool = False) -> None:
        """``env``: extra environment of serve.sh (``ROLE``, ``PD_REGISTRY_URL``, ...) over ``base_env``
        (default this process's environment; a host of ``scripts/fleet`` gives ``fleet.netns.project_env()``,
        without this process's transport settings);
        ``ports``: (http, grpc, metrics, registry) to reuse (a restarted server), else free ones;
        ``launcher``: argv that runs serve.sh (``ip netns exec <ns>``: a host of ``scripts/fleet``; it must
        exec, so that the process group is serve.sh's); the caller then points the URLs at where it reaches
        them.

        Configs: a given ``model_repository`` (or ``MODEL_REPOSITORY`` in ``env``) is completed in place
        (``complete_repository``); without one,
        serve.sh gets a copy of ``model_repository/`` with complete configs (``build_model_repository``), so
        that its starts and restarts skip tritonserver's auto-complete stage (~1.3 s a model load), unless
        ``in_place``: then it serves ``model_repository/`` itself, whose models declare their outputs through
        auto-complete (what a user's ``scripts/serve.sh`` does)."""
        http, grpc, metrics, registry = ports or free_ports(4)
        self.ports = (http, grpc, metrics, registry)
        self.http_url, self.grpc_url = f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.registry_url = f"http://127.0.0.1:{registry}"
        self.log_path = log_path
        names = models.split(",")
        # a server with its own router and workers is ready once the router sees a prefill and a decode
        self._router_with_workers = "pd_ensemble" in names and any(n.startswith("prefill") for n in names) \
            and any(n.startswith("decode") for n in names)
        self._env = {**(os.environ if base_env is None else base_env),
                     "SKIP_SETUP": "1", "MODELS": models, "HTTP_PORT": str(http),
                     "GRPC_PORT": str(grpc), "METRICS_PORT": str(metrics), "REGISTRY_PORT": str(registry),
                     # no OpenAI front on its fixed port unless asked (env OPENAI=1, OPENAI_PORT)
                     "OPENAI": "0",
                     **(env or {})}
        if model_repository is None and self._env.get("MODEL_REPOSITORY"):   # given through ``env``
            model_repository = Path(self._env["MODEL_REPOSITORY"])
        if model_repository is not None and model_repository.resolve() == REPO_ROOT / "model_repository":
            model_repository, in_place = None, True   # the committed configs are never rewritten
        if model_repository is not None:
            model_repository = complete_repository(model_repository)
        elif not in_place:
            copy = Path(tempfile.mkdtemp(prefix="serve-models-"))
            weakref.finalize(self, shutil.rmtree, copy, ignore_errors=True)
            every = tuple(sorted(d.name for d in (REPO_ROOT / "model_repository").iterdir()
                                 if (d / "config.pbtxt").is_file()))
            model_repository = build_model_repository(Deployment("serve", "pd_ensemble", every),
                                                      copy / "models")
        if model_repository is not None:
            self._env["MODEL_REPOSITORY"] = str(model_repository)
        self._launcher = list(launcher)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> ServeScript:
        """Starts serve.sh and waits for ``/v2/health/ready`` and ``/metrics`` and, when it serves pd_ensemble
        with prefill and decode models, for the router's ``pd_router_ready`` gauge (Triton's readiness says
        the models loaded, not that the router has seen the workers' first heartbeats: until then it answers
        "no healthy ... instance"). Raises RuntimeError (serve.sh exited) or TimeoutError (not ready in
        ``timeout_s``), both with the log's tail."""
        start_s = time.monotonic()
        proc = self.start_background()
        wait_ready(self.http_url, proc, timeout_s, self.log_tail)
        # Triton binds its metrics port after HTTP says ready; a taken one ends the start (serve.sh exits)
        wait_http_ok(self.metrics_url, proc, max(5.0, timeout_s - (time.monotonic() - start_s)),
                     lambda: f"serve.sh exited with {proc.returncode} after ready:\n{self.log_tail()}",
                     lambda: f"no metrics on {self.metrics_url} within {timeout_s:.0f} s:\n{self.log_tail()}",
                     poll_s=0.1)
        # how long a start takes here (tests scale bounds by it)
        self.start_seconds = time.monotonic() - start_s
        if self._router_with_workers:
            while not self._router_ready():
                if time.monotonic() - start_s > timeout_s:
                    raise TimeoutError(f"pd_router_ready not 1 within {timeout_s:.0f} s:\n{self.log_tail()}")
                time.sleep(0.2)
        return self

    def start_background(self) -> subprocess.Popen[bytes]:
        """Starts serve.sh and returns at once (``ROLE=frontend`` runs no tritonserver to wait for)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # a restart on the same object appends: earlier runs stay readable
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen([*self._launcher, str(REPO_ROOT / "scripts" / "serve.sh")],
                                          cwd=REPO_ROOT,
                                          env=self._env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        _started.add(self)
        return self._proc

    def _router_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        return routers_ready(text, ("pd_ensemble",))

    def kill(self) -> None:
        """SIGKILL serve.sh, tritonserver and every stub at once (a server that dies); removes their shm
        regions. The object can be started again on the same ports afterwards."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        _started.discard(self)
        regions = shm_regions_of_group(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for region in regions:
            Path("/dev/shm", region).unlink(missing_ok=True)

    def stub_pids(self) -> list[int]:
        """PIDs of the python-backend stubs this server runs now ([] when not started)."""
        return stub_pids_of_group(self._proc.pid) if self._proc is not None else []

    def _dump_stubs(self, pgid: int, after_s: float) -> None:
        pids = stub_pids_of_group(pgid)
        dumping = [pid for pid in pids if catches_signal(pid, signal.SIGUSR1)]
        with self.log_path.open("a") as log:
            log.write(f"[perf.server] still stopping after {after_s:.0f} s: stubs {pids}, SIGUSR1 to those "
                      f"not yet finalized {dumping}\n")
        for pid in dumping:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    def log_tail(self, num_chars: int = 4000) -> str:
        """The log's last ``num_chars`` characters, after any crash report found before them
        (``log_excerpt``)."""
        return log_excerpt(self.log_path.read_text(errors="replace"), num_chars)

    def stop(self, timeout_s: float, dump_after_s: float | None = None) -> tuple[float, bool]:
        """SIGTERM the group (serve.sh stops tritonserver, then the bootstrap), SIGKILL after ``timeout_s``,
        then any straggler of the group (stubs outlive a crashed server); removes the shm regions the stubs
        named. ``dump_after_s``: a stop still running then has every stub that still handles SIGUSR1 (its
        model not yet finalized: ``serving.triton.host.setup_logging``) dump its Python threads' stacks into
        the server log, so a slow stop shows where it waits (a stub without the handler has finalized its
        model).
        Returns (seconds the stop took, whether SIGKILL was needed); (0, False) if never started."""
        if self._proc is None:
            return 0.0, False
        proc, self._proc = self._proc, None
        _started.discard(self)
        regions = shm_regions_of_group(proc.pid)
        start, killed = time.monotonic(), False
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:   # the whole group exited already (serve.sh ended by itself)
            pass
        try:
            if dump_after_s is not None and dump_after_s < timeout_s:
                try:
                    proc.wait(dump_after_s)
                except subprocess.TimeoutExpired:
                    self._dump_stubs(proc.pid, dump_after_s)
            proc.wait(max(0.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            killed = True
            logger.warning("serve.sh still running after %.0f s: SIGKILL", timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        elapsed = time.monotonic() - start
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for region in regions:
            Path("/dev/shm", region).unlink(missing_ok=True)
        return elapsed, killed


@contextlib.contextmanager
def supervised(server: ServeScript, ready_timeout_s: float, stop_timeout_s: float,
               clean_stop_s: float) -> Iterator[ServeScript]:
    """Start ``server``, yield it, stop it; then raise AssertionError when the stop was unclean (killed, or
    slower than ``clean_stop_s``: a request left without FINAL keeps tritonserver waiting) or when the kernel
    log (where readable) reports one of its stubs killed by a fault (a stub crashing on its way out leaves no
    other trace). The live fixtures' teardown."""
    stubs: list[int] = []
    kernel_before = kernel_log()
    try:
        server.start(ready_timeout_s)
        stubs = server.stub_pids()
        yield server
    finally:
        elapsed, killed = server.stop(stop_timeout_s, dump_after_s=clean_stop_s)
    assert not killed and elapsed < clean_stop_s, \
        f"unclean shutdown ({elapsed:.1f} s, killed={killed}):\n{server.log_tail(12000)}"
    kernel_after = kernel_log()
    if kernel_before is not None and kernel_after is not None:
        seen = set(kernel_before)
        faults = fault_lines([line for line in kernel_after if line not in seen], stubs)
        assert not faults, "a python-backend stub died by a fault:\n" + "\n".join(faults)


class RegistryProcess:
    """The fleet's membership registry in its own process (``python -m bootstrap.membership``, as
    ``ROLE=registry scripts/serve.sh`` runs it) on a free loopback port; ``url`` is what ``PD_REGISTRY_URL``
    takes. ``start`` waits for ``/health``; ``stop(kill=True)`` is a ``kill -9``. Startable again after a
    stop."""

    def __init__(self, log_path: Path, ttl_s: float = 5.0, port: int | None = None) -> None:
        self.port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path, self._ttl_s = log_path, ttl_s
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> RegistryProcess:
        log = open(self._log_path, "ab")  # noqa: SIM115 - the child owns it until it exits
        self._proc = subprocess.Popen([sys.executable, "-m", "bootstrap.membership", "--host", "127.0.0.1",
                                       "--port", str(self.port), "--ttl-s", str(self._ttl_s)],
                                      cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        proc = self._proc
        wait_http_ok(f"{self.url}/health", proc, timeout_s,
                     lambda: f"the registry exited with {proc.returncode}",
                     lambda: f"the registry did not answer within {timeout_s:.0f} s", poll_s=0.1)
        return self

    def stop(self, kill: bool = False) -> None:
        if self._proc is not None:
            self._proc.kill() if kill else self._proc.terminate()
            self._proc.wait(10)
            self._proc = None
