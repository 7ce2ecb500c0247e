"""No crash at any stop (issue #50 item 5): SIGTERM at a random moment of a server's start, 12 tries, each to
``scripts/serve.sh`` alone (what a supervisor sends) or to its whole process group (a terminal's signals reach
every process of the group: serve.sh, tritonserver, its stubs and their guardians).

A try fails on any of: serve.sh still running 60 s after the signal; a process of the group still running 5 s
after serve.sh exited (an orphaned stub, a guardian, tritonserver); a shared-memory region a stub of the try
named still in ``/dev/shm``; a crash report in the server log (faulthandler's "Fatal Python error",
libstdc++'s "terminate called", a segfault or abort, or python_backend's "Non-graceful termination detected":
the stub's teardown under its running threads, where those crashes came from); a model that had loaded when
tritonserver took the stop but was never finalized (a tritonserver that died instead of stopping); a fault of
one of its processes in the kernel log, where readable.

Lean: one tiny colocated model (``perf/tiny_model.py``), so a start takes a few seconds; the delays are drawn
over the whole start (serve.sh's own set-up, the stub's interpreter start, the model's ``initialize``, ready).
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from live_client import StreamResult, grpc_generate, make_inputs
from perf.server import SHM_PREFIX, Deployment, ServeScript, build_model_repository, kernel_log, wait_ready

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.timeout(1200)]
TRIES = 12   # in CI; 20 and more were run by hand (docs/healing.md)
CRASH = re.compile(r"Fatal Python error|terminate called|Segmentation fault|Aborted|core dumped|"
                   r"Non-graceful termination|corrupted|double free|Signal \((6|11)\) received")


@dataclass
class Seen:
    """What one try's processes showed while they ran: every pid of the group and every stub's region."""

    pids: dict[int, str] = field(default_factory=dict)
    regions: set[str] = field(default_factory=set)


def watch_group(pgid: int, seen: Seen, stop: threading.Event) -> None:
    """Every 10 ms: the processes of group ``pgid`` and the shared-memory regions on their command lines."""
    while not stop.is_set():
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if os.getpgid(int(proc.name)) != pgid:
                    continue
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except (OSError, ProcessLookupError):
                continue
            seen.pids.setdefault(int(proc.name), b" ".join(args[:3]).decode(errors="replace"))
            seen.regions.update(a.decode() for a in args if a.startswith(SHM_PREFIX.encode()))
        stop.wait(0.01)


def group_left(pgid: int) -> list[str]:
    """The processes still running in group ``pgid``, as ``pid cmdline`` (a zombie has ended: its parent, or
    init for an orphan, has yet to reap it)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
                if os.getpgid(int(proc.name)) == pgid and state not in ("Z", "X"):
                    out.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
            except (OSError, ProcessLookupError, IndexError):
                continue
    return out


def one_try(server: ServeScript, delay_s: float, whole_group: bool,
            before: Callable[[], None] = lambda: None) -> list[str]:
    """Start ``server`` (in the background; ``before`` runs next, e.g. waits for ready and starts a reload),
    SIGTERM it ``delay_s`` later; the list of what went wrong (empty: a clean stop)."""
    offset = server.log_path.stat().st_size if server.log_path.exists() else 0
    proc = server.start_background()
    seen, stop = Seen(), threading.Event()
    watcher = threading.Thread(target=watch_group, args=(proc.pid, seen, stop))
    watcher.start()
    problems: list[str] = []
    try:
        before()
        time.sleep(delay_s)
        (os.killpg if whole_group else os.kill)(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            problems.append("serve.sh still running 60 s after SIGTERM")
        left = group_left(proc.pid)
        deadline = time.monotonic() + 5.0   # a short-lived helper of serve.sh may finish what it was doing
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = group_left(proc.pid)
        if left:
            problems.append(f"left running: {left}")
    finally:
        stop.set()
        watcher.join()
        server.stop(10.0)   # whatever is left (a failed try) is killed, its regions removed
    leaked = sorted(r for r in seen.regions if Path("/dev/shm", r).exists())
    if leaked:
        problems.append(f"shared memory left: {leaked}")
    with server.log_path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    crashes = [line for line in text.splitlines() if CRASH.search(line)]
    if crashes:
        problems.append(f"crash reports: {crashes[:10]}")
    took_it = "successfully loaded 'colocated'" in text and "still loading" not in text
    if took_it and "finalized in" not in text and "colocated unloaded: drained" not in text:
        problems.append("tritonserver took the stop with its model loaded, but the model was never finalized")
    return problems


def test_sigterm_at_random_moments_of_a_start_leaves_no_crash_orphan_or_shared_memory(
        tmp_path: Path) -> None:
    from perf.tiny_model import build_tiny_llama

    pytest.importorskip("pytriton")
    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    repo = build_model_repository(Deployment("colo", "colocated", ("colocated",),
                                             overrides={"colocated": {"model": tiny}}), tmp_path / "models")
    server = ServeScript("colocated", tmp_path / "server.log", repo)
    kernel_before = kernel_log()
    began = time.monotonic()
    server.start(180.0)   # how long a start takes here: the delays are drawn over it
    start_s = time.monotonic() - began
    stop_s, killed = server.stop(60.0)
    assert not killed, server.log_tail()
    rng = random.Random(50)
    failures: dict[str, list[str]] = {}
    outcomes = []
    for i in range(TRIES):
        delay_s, whole_group = rng.uniform(0.0, start_s * 1.6), i % 2 == 1
        problems = one_try(ServeScript("colocated", tmp_path / f"try{i}.log", repo), delay_s, whole_group)
        outcomes.append(f"{delay_s:.2f}s{'/group' if whole_group else ''}")
        if problems:
            to = " to the group" if whole_group else ""
            failures[f"try {i} (SIGTERM at {delay_s:.2f} s{to})"] = problems
    kernel_after = kernel_log()
    if kernel_before is not None and kernel_after is not None:
        new = [line for line in kernel_after if line not in set(kernel_before)]
        faults = [line for line in new if re.search(r"triton_python|tritonserver|python3", line)
                  and re.search(r"segfault|general protection|trap", line)]
        assert not faults, f"faults in the kernel log: {faults}"
    print(f"a start took {start_s:.1f} s, a stop after ready {stop_s:.1f} s; tries: {' '.join(outcomes)}")
    assert not failures, "\n".join(f"{name}: {problems}" for name, problems in failures.items())


RELOAD_TRIES = 4


def reload_in_place(server: ServeScript, timeout_s: float = 300.0) -> requests.Response:
    """A load of the loaded ``colocated`` with a changed config (tritonserver loads a new version next to the
    old one, then unloads the old one): what an operator's config change does."""
    config = requests.get(f"{server.http_url}/v2/models/colocated/config", timeout=10).json()
    config["parameters"]["waiting_timeout_s"] = {"string_value": str(100 + time.monotonic_ns() % 1000)}
    return requests.post(f"{server.http_url}/v2/repository/models/colocated/load",
                         json={"parameters": {"config": __import__("json").dumps(config)}}, timeout=timeout_s,
                         headers={"Connection": "close"})


def test_sigterm_during_a_reload_under_load_leaves_no_crash_orphan_or_shared_memory(tmp_path: Path) -> None:
    """Issue #50 item 5, the other moments: a SIGTERM while a reload in place loads the new version next to
    the old one, with streams running on the old one (4 tries, the delay drawn over a reload's length):
    besides the checks of a start's tries, the streams must run to their end (the stop drains them)."""
    from perf.tiny_model import build_tiny_llama

    pytest.importorskip("pytriton")
    tiny = str(build_tiny_llama(tmp_path / "tiny"))
    repo = build_model_repository(Deployment("colo", "colocated", ("colocated",),
                                             overrides={"colocated": {"model": tiny}}), tmp_path / "models")
    server = ServeScript("colocated", tmp_path / "server.log", repo)
    server.start(180.0)
    began = time.monotonic()
    assert reload_in_place(server).status_code == 200
    reload_s = time.monotonic() - began
    server.stop(60.0)
    params = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}   # still streaming at the stop
    rng = random.Random(51)
    failures: dict[str, list[str]] = {}
    for i in range(RELOAD_TRIES):
        delay_s = rng.uniform(0.0, reload_s * 1.5)
        pool = ThreadPoolExecutor(3)
        try_server = ServeScript("colocated", tmp_path / f"reload{i}.log", repo)
        streams: list[Future[StreamResult]] = []

        def under_load_then_reload(srv: ServeScript = try_server, pool: ThreadPoolExecutor = pool,
                                   streams: list[Future[StreamResult]] = streams) -> None:
            assert srv._proc is not None
            wait_ready(srv.http_url, srv._proc, 180.0, srv.log_tail)
            streams.extend(pool.submit(grpc_generate, srv.grpc_url, make_inputs(f"Story {n}:", params))
                           for n in range(2))
            time.sleep(0.5)
            pool.submit(reload_in_place, srv, 120.0)

        problems = one_try(try_server, delay_s, False, before=under_load_then_reload)
        pool.shutdown(wait=True)
        for n, future in enumerate(streams):   # the stop drained them: every token, one FINAL
            res = future.result()
            whole = res.num_output_tokens[-1] == params["max_tokens"]
            if res.error is not None or not res.final_seen or not whole:
                problems.append(f"stream {n} cut: error {res.error!r}, FINAL {res.final_seen}")
        if problems:
            failures[f"reload try {i} (SIGTERM {delay_s:.2f} s into the reload)"] = problems
    print(f"a reload took {reload_s:.1f} s")
    assert not failures, "\n".join(f"{name}: {problems}" for name, problems in failures.items())
