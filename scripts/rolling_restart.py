"""Rolling restart under load: every server of a PD fleet restarted one at a time while clients stream, and
nothing may be lost (issue #50 item 2).

The fleet, each process started as the README's "Across servers" commands start it (loopback, distinct ports):
the membership registry, a router server, ``--prefills`` prefill and ``--decodes`` decode servers (2 and 2).
The load is ``scripts/bench_soak.py``'s (``--concurrency`` streams, mixed prompt lengths,
``--cancel-fraction`` of the requests cancelled by the client), sent through a client-side balancer over the
routers in rotation (what a Kubernetes Service is to the router pods).

The procedure, one server at a time, each waited for until the fleet is whole again (the router lists every
prefill and decode instance healthy) before the next (docs/healing.md, "Rolling restart"):

1. the registry: stopped (SIGTERM) and started again on its port; membership freezes meanwhile;
2. each prefill, then each decode server: SIGTERM (it drains: out of the fleet at once, its rooms finish, a
   decode's streams are moved to the other decode by the router), started again on the same ports once it
   exited;
3. the router, as a rolling update with one surge replica does it: a new router server starts on new ports and
   joins the rotation; the old one leaves the rotation (what a ``preStop`` sleep gives a load balancer:
   ``--prestop-s``), then gets SIGTERM and drains its open streams.

Printed, and the exit status (1 on a failure): requests, errors (must be 0), streams without FINAL (0), KV
pages in use on the workers after the load (0), each stop (seconds; clean: no SIGKILL, within the exit
timeout), crash reports in the server logs and faults in the kernel log (0).

    .venv/bin/python scripts/rolling_restart.py --concurrency 16 --cancel-fraction 0.2 --out docs/rolling.json
    .venv/bin/python scripts/rolling_restart.py --model smollm2     # the real model (slower starts)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from bench_soak import ERROR_BACKOFF_S, SoakConfig, SoakRun, read_pages, send_one  # noqa: E402
from perf.server import (  # noqa: E402
    Deployment,
    RegistryProcess,
    ServeScript,
    build_model_repository,
    fault_lines,
    healthy_instances,
    kernel_log,
)
from perf.soak import Outcome, SoakWorkload, draw_spec, summarize  # noqa: E402

logger = logging.getLogger("rolling_restart")
READY_TIMEOUT_S = 300.0
#: A crash report in a server log: faulthandler, libstdc++, glibc, a stub torn down under its threads.
CRASH = re.compile(r"Fatal Python error|terminate called|Segmentation fault|core dumped|"
                   r"Non-graceful termination|corrupted|double free|Signal \((6|11)\) received")


@dataclass
class Step:
    """One restart: which server, how its stop went, and how long until the fleet was whole again."""

    server: str
    stop_s: float = 0.0
    killed: bool = False
    whole_after_s: float | None = None


class Rotation:
    """The routers a client-side balancer sends new requests to (round robin); any thread."""

    def __init__(self, urls: list[str]) -> None:
        self._urls = list(urls)
        self._next = 0
        self._lock = threading.Lock()

    def pick(self) -> str:
        with self._lock:
            self._next += 1
            return self._urls[self._next % len(self._urls)]

    def add(self, url: str) -> None:
        with self._lock:
            self._urls.append(url)

    def remove(self, url: str) -> None:
        with self._lock:
            self._urls.remove(url)


class BalancedSoak(SoakRun):
    """``SoakRun`` whose requests go to the routers of a ``Rotation`` (one client per router), until
    ``stop``."""

    def __init__(self, cfg: SoakConfig, rotation: Rotation, metrics_url: str) -> None:
        super().__init__(cfg, rotation.pick(), metrics_url, None)
        self.rotation = rotation
        self.stop = threading.Event()
        self._clients: dict[str, Any] = {}

    async def run(self) -> float:
        """Issue until ``stop`` (or ``duration_s``), then let the open requests end; the wall time in s."""
        self._start_s = time.perf_counter()
        issue_end_s = self._start_s + self.cfg.duration_s
        drain_end_s = issue_end_s + self.cfg.drain_s
        try:
            await asyncio.gather(*(self._balanced_slot(issue_end_s, drain_end_s)
                                   for _ in range(self.cfg.concurrency)))
        finally:
            for client in self._clients.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), timeout=10)
        return time.perf_counter() - self._start_s

    async def _balanced_slot(self, issue_end_s: float, drain_end_s: float) -> None:
        import tritonclient.grpc.aio as grpcclient

        while time.perf_counter() < issue_end_s and not self.stop.is_set():
            spec = draw_spec(self.cfg.workload, self._next_index)
            self._next_index += 1
            url = self.rotation.pick()
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = grpcclient.InferenceServerClient(url)
            self._open += 1
            try:
                record = await send_one(client, self.cfg.model, spec, self.cfg.request_timeout_s, drain_end_s)
            finally:
                self._open -= 1
            self.records.append(record)
            if record.outcome is Outcome.ERROR:
                logger.error("%s on %s: %s", spec.request_id, url, record.error)
                await asyncio.sleep(ERROR_BACKOFF_S)


class RollingFleet:
    """The fleet's processes on free loopback ports (logs in ``log_dir``), the model ``model`` everywhere."""

    def __init__(self, log_dir: Path, model: str, prefills: int, decodes: int, drain_timeout_s: int) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.size = (prefills, decodes)
        self.registry = RegistryProcess(log_dir / "registry.log")
        worker = {"model": model, "num_pages": "2048"}
        self._repo_dir = tempfile.TemporaryDirectory(prefix="rolling-")
        repo = build_model_repository(Deployment("pd", "pd_ensemble", ("pd_ensemble", "prefill", "decode"),
                                                 overrides={"prefill": worker, "decode": worker,
                                                            "pd_ensemble": {"tokenizer": model}}),
                                      Path(self._repo_dir.name) / "models")
        self._env = {"PD_REGISTRY_URL": self.registry.url, "MODEL_REPOSITORY": str(repo),
                     "DRAIN_TIMEOUT_S": str(drain_timeout_s)}
        self.routers = [self._router(0)]
        names = [f"prefill_{i}" for i in range(prefills)] + [f"decode_{i}" for i in range(decodes)]
        self.workers = {name: ServeScript(name.split("_")[0], log_dir / f"{name}.log",
                                          env={**self._env, "ROLE": name.split("_")[0]}) for name in names}
        self.stub_pids: set[int] = set()

    def _router(self, index: int) -> ServeScript:
        return ServeScript("pd_ensemble", self.log_dir / f"router_{index}.log",
                           env={**self._env, "ROLE": "router"})

    @property
    def servers(self) -> list[ServeScript]:
        return [*self.routers, *self.workers.values()]

    def start(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.registry.start()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            for done in [pool.submit(s.start, READY_TIMEOUT_S) for s in self.servers]:
                done.result()
        if self.wait_whole(self.routers[0], READY_TIMEOUT_S) is None:
            raise TimeoutError("the router never listed the whole fleet")

    def healthy(self, router: ServeScript) -> tuple[int, int]:
        """(prefill, decode) instances ``router`` lists healthy; (0, 0) while it does not answer."""
        return healthy_instances(router.metrics_url)

    def wait_whole(self, router: ServeScript, timeout_s: float) -> float | None:
        """Seconds until ``router`` lists every prefill and decode instance healthy; None after
        ``timeout_s``."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.healthy(router) == self.size:
                return time.monotonic() - began
            time.sleep(0.2)
        return None

    def note_stubs(self) -> None:
        for server in self.servers:
            self.stub_pids.update(server.stub_pids())

    def pages_in_use(self) -> dict[str, int | None]:
        pages: dict[str, int | None] = {}
        for name, server in self.workers.items():
            per_instance = read_pages(server.metrics_url)
            pages[name] = None if per_instance is None else sum(per_instance.values())
        return pages

    def crash_reports(self) -> list[str]:
        """Crash lines in every server log of the run."""
        lines = []
        for log in sorted(self.log_dir.glob("*.log")):
            lines += [f"{log.name}: {line}" for line in log.read_text(errors="replace").splitlines()
                      if CRASH.search(line)]
        return lines

    def stop(self) -> None:
        self.note_stubs()
        for server in self.servers:
            server.stop(60.0)
        self.registry.stop()
        self._repo_dir.cleanup()


def restart_in_place(fleet: RollingFleet, name: str, server: ServeScript, stop_timeout_s: float) -> Step:
    """SIGTERM ``server`` (it drains), wait for its exit, start it again on the same ports."""
    fleet.note_stubs()
    step = Step(name)
    step.stop_s, step.killed = server.stop(stop_timeout_s)
    logger.info("%s stopped in %.1f s%s; starting it again", name, step.stop_s,
                " (SIGKILL)" if step.killed else "")
    server.start(READY_TIMEOUT_S)
    return step


def replace_router(fleet: RollingFleet, rotation: Rotation, prestop_s: float, stop_timeout_s: float) -> Step:
    """A surge router joins the rotation; the old one leaves it, waits ``prestop_s``, then drains and
    stops."""
    old = fleet.routers[-1]
    new = fleet._router(len(fleet.routers))
    new.start(READY_TIMEOUT_S)
    fleet.wait_whole(new, READY_TIMEOUT_S)
    rotation.add(new.grpc_url)
    rotation.remove(old.grpc_url)
    fleet.routers.append(new)
    time.sleep(prestop_s)   # the load balancer's view of the rotation settles before the SIGTERM
    fleet.note_stubs()
    step = Step("router")
    step.stop_s, step.killed = old.stop(stop_timeout_s)
    fleet.routers.remove(old)
    logger.info("old router stopped in %.1f s%s", step.stop_s, " (SIGKILL)" if step.killed else "")
    return step


def roll(fleet: RollingFleet, rotation: Rotation, args: argparse.Namespace) -> list[Step]:
    """The procedure of the module docstring; each step waited for until the fleet is whole again."""
    stop_timeout_s = args.drain_timeout_s + 15 + 20   # serve.sh: the exit timeout + 10 s, then SIGKILL
    steps = []
    time.sleep(args.warmup_s)
    fleet.note_stubs()
    began = time.monotonic()
    fleet.registry.stop()
    registry = Step("registry", stop_s=time.monotonic() - began)
    fleet.registry.start()
    registry.whole_after_s = fleet.wait_whole(fleet.routers[-1], 60.0)
    steps.append(registry)
    time.sleep(args.settle_s)
    for name, server in fleet.workers.items():
        step = restart_in_place(fleet, name, server, stop_timeout_s)
        step.whole_after_s = fleet.wait_whole(fleet.routers[-1], READY_TIMEOUT_S)
        steps.append(step)
        time.sleep(args.settle_s)
    step = replace_router(fleet, rotation, args.prestop_s, stop_timeout_s)
    step.whole_after_s = fleet.wait_whole(fleet.routers[-1], READY_TIMEOUT_S)
    steps.append(step)
    time.sleep(args.settle_s)
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help="'tiny' (perf/tiny_model.py, built here) or a model name or folder")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--drain-timeout-s", type=int, default=30,
                   help="serve.sh's DRAIN_TIMEOUT_S for every server")
    p.add_argument("--prestop-s", type=float, default=2.0,
                   help="the old router's time out of rotation before its SIGTERM (a preStop sleep)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="load before the first restart")
    p.add_argument("--settle-s", type=float, default=5.0, help="load between a restart and the next")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "artifacts" / "rolling_restart")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parse_args(argv)
    model_dir = tempfile.TemporaryDirectory(prefix="rolling-model-")
    model = args.model
    if model == "tiny":
        from perf.tiny_model import build_tiny_llama

        model = str(build_tiny_llama(Path(model_dir.name) / "tiny", args.seed))
    fleet = RollingFleet(args.log_dir, model, args.prefills, args.decodes, args.drain_timeout_s)
    kernel_before = kernel_log()
    try:
        fleet.start()
    except (RuntimeError, TimeoutError) as exc:
        logger.error("the fleet did not start: %s", exc)
        fleet.stop()
        return 2
    rotation = Rotation([fleet.routers[0].grpc_url])
    workload = SoakWorkload(max_new_tokens=args.max_new_tokens, cancel_fraction=args.cancel_fraction,
                            seed=args.seed)
    first = fleet.routers[0]
    cfg = SoakConfig(model="pd_ensemble", url=first.grpc_url, metrics_url=first.metrics_url, launch=True,
                     models="", duration_s=3600.0, drain_s=args.request_timeout_s,
                     request_timeout_s=args.request_timeout_s, pages_wait_s=0.0, concurrency=args.concurrency,
                     progress_s=30.0, workload=workload, out=None, log_dir=args.log_dir)
    load = BalancedSoak(cfg, rotation, fleet.routers[0].metrics_url)
    steps: list[Step] = []
    failure: list[BaseException] = []

    def rolling() -> None:
        try:
            steps.extend(roll(fleet, rotation, args))
        except BaseException as exc:   # noqa: BLE001 - reported below, the load stops either way
            failure.append(exc)
        finally:
            load.stop.set()

    roller = threading.Thread(target=rolling, name="rolling-restart")
    roller.start()
    try:
        duration_s = asyncio.run(load.run())
    finally:
        load.stop.set()
        roller.join(READY_TIMEOUT_S * 3)
    deadline = time.monotonic() + 30.0
    pages = fleet.pages_in_use()
    while any(p != 0 for p in pages.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
        pages = fleet.pages_in_use()
    crashes = fleet.crash_reports()
    fleet.stop()
    kernel_after = kernel_log()
    faults = [] if kernel_before is None or kernel_after is None else fault_lines(
        [line for line in kernel_after if line not in set(kernel_before)], sorted(fleet.stub_pids))
    model_dir.cleanup()

    summary = summarize(load.records, duration_s, sum(p or 0 for p in pages.values()), [])
    stop_bound_s = args.drain_timeout_s + 15
    summary.update(steps=[vars(s) for s in steps], pages_by_worker=pages, crash_reports=crashes[:20],
                   stub_faults=faults, concurrency=args.concurrency, cancel_fraction=args.cancel_fraction,
                   model=args.model, load_avg=[round(v, 2) for v in os.getloadavg()])
    failed = [f"the procedure failed: {failure[0]!r}"] if failure else []
    if summary["errors"]:
        failed.append(f"{summary['errors']} failed requests {summary['errors_by_kind']}")
    if summary["streams_without_final"]:
        failed.append(f"{summary['streams_without_final']} streams without FINAL")
    if any(p != 0 for p in pages.values()):
        failed.append(f"KV pages not returned: {pages}")
    unclean = [s.server for s in steps if s.killed or s.stop_s > stop_bound_s or s.whole_after_s is None]
    if unclean:
        failed.append(f"unclean stops or a fleet never whole again: {unclean}")
    if crashes or faults:
        failed.append(f"crash reports {crashes[:5]}, faults {faults[:5]}")
    summary["failures"] = failed
    print(f"rolling restart: {duration_s:.0f} s under {args.concurrency} streams ({args.cancel_fraction:.0%} "
          f"client cancels), model {args.model}")
    for s in steps:
        whole = "never" if s.whole_after_s is None else f"{s.whole_after_s:.1f} s"
        killed = " SIGKILL" if s.killed else ""
        print(f"  {s.server:<10} stop {s.stop_s:5.1f} s{killed}, fleet whole {whole} later")
    print(f"  requests {summary['requests_sent']}: ok {summary['completed_ok']}, cancelled "
          f"{summary['cancelled']}, failed {summary['errors']} (must be 0), without FINAL "
          f"{summary['streams_without_final']} (must be 0), timed out while streaming "
          f"{summary['timed_out_streaming']}; pages in use after {pages} (must be 0)")
    print("FAIL: " + "; ".join(failed) if failed else "PASS", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
