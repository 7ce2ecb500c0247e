"""Chaos soak: a PD fleet of separate servers under load while a random process is killed (``-9``) and
restarted.

The fleet, each process started as the README's "Across servers" commands start it (loopback, distinct ports):
the membership registry (``python -m bootstrap.membership``), a router server (``ROLE=router``), the OpenAI
front (``ROLE=frontend``), two prefill servers and two decode servers (``ROLE=prefill``/``decode``). The load
is ``scripts/bench_soak.py``'s: ``--concurrency`` client slots over gRPC to the router, mixed prompt lengths,
random ``max_tokens``, ``--cancel-fraction`` cancelled by the client. Every ``--kill-interval-s`` a random
process of the fleet is killed with SIGKILL (the whole serve.sh group: tritonserver and its stubs die with it)
and started again at once on the same ports, as a supervisor (systemd, Kubernetes) would; the time until the
fleet is back at full strength (the router lists every prefill and decode instance healthy, the front answers)
is recorded.

Printed: requests, errors by kind, errors outside any kill window (a request that no killed process was
serving must not fail: these must be 0), streams without FINAL (0), KV pages not returned after the drain on
every surviving worker (0), the heal times (p50, max; each must be within ``--heal-bound-s``), whether every
server then stopped cleanly (SIGTERM, within 15 s, no stub killed by a fault in the kernel log). Exit 1 when a
must-be-0 figure is not 0, a heal exceeded its bound, or a stop was unclean.

    .venv/bin/python scripts/bench_chaos.py --duration-s 1800 --concurrency 32 --out docs/bench_chaos.json
    .venv/bin/python scripts/bench_chaos.py --duration-s 60 --kill-interval-s 20 --concurrency 4 \
        --prefills 1 --decodes 1 --max-new-tokens 32 --cancel-fraction 0                     # CI smoke
    .venv/bin/python scripts/bench_chaos.py --kv-backend mooncake ...                       # KV over Mooncake
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from bench_soak import SoakConfig, SoakRun, read_pages  # noqa: E402 - needs scripts/ on sys.path
from perf.server import (  # noqa: E402
    Deployment,
    RegistryProcess,
    ServeScript,
    build_model_repository,
    fault_lines,
    free_ports,
    healthy_instances,
    kernel_log,
)
from perf.soak import Outcome, SoakWorkload, classify_error, summarize  # noqa: E402
from perf.stats import percentile  # noqa: E402

logger = logging.getLogger("bench_chaos")
READY_TIMEOUT_S = 300.0
CLEAN_STOP_S = 15.0


@dataclass
class Kill:
    """One kill: which process, when (perf_counter s), and when the fleet was whole again (None: never)."""

    victim: str
    killed_s: float
    healed_s: float | None = None

    @property
    def heal_seconds(self) -> float | None:
        return None if self.healed_s is None else self.healed_s - self.killed_s


class ChaosFleet:
    """The fleet's processes on free loopback ports; logs in ``log_dir``."""

    def __init__(self, log_dir: Path, prefills: int = 2, decodes: int = 2, kv_backend: str = "") -> None:
        """``kv_backend``: the workers' ``kv_backend`` ("nixl" or "mooncake"; "": model_repository's own)
        through a repository of ``pd_ensemble``, ``prefill`` and ``decode`` written under ``log_dir`` (their
        ``1/`` linked)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.size = (prefills, decodes)
        self.registry = RegistryProcess(log_dir / "registry.log")
        env = {"PD_REGISTRY_URL": self.registry.url}
        if kv_backend:
            repository = log_dir / f"models-{kv_backend}"
            shutil.rmtree(repository, ignore_errors=True)
            backend = {"kv_backend": kv_backend}
            build_model_repository(Deployment("chaos", "pd_ensemble", ("pd_ensemble", "prefill", "decode"),
                                              overrides={"prefill": backend, "decode": backend}), repository)
            env["MODEL_REPOSITORY"] = str(repository)
        self.router = ServeScript("pd_ensemble", log_dir / "router.log", env={**env, "ROLE": "router"})
        self.front_port = free_ports(1)[0]
        self.front = ServeScript("", log_dir / "front.log", env={
            "ROLE": "frontend", "OPENAI": "1", "OPENAI_PORT": str(self.front_port),
            "GRPC_URL": self.router.grpc_url})
        names = [f"prefill_{i}" for i in range(prefills)] + [f"decode_{i}" for i in range(decodes)]
        self.workers = {name: ServeScript(name.split("_")[0], log_dir / f"{name}.log",
                                          env={**env, "ROLE": name.split("_")[0]}) for name in names}
        self.stub_pids: set[int] = set()   # every stub seen, for the kernel log's fault lines at the end

    @property
    def servers(self) -> dict[str, ServeScript]:
        return {"router": self.router, **self.workers}

    def start(self) -> None:
        """The registry, then every server at once (each start is mostly waiting on model loads)."""
        from concurrent.futures import ThreadPoolExecutor

        self.registry.start()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            for done in [pool.submit(server.start, READY_TIMEOUT_S) for server in self.servers.values()]:
                done.result()
        self.start_front()
        self.wait_whole(READY_TIMEOUT_S)

    def start_front(self) -> None:
        """serve.sh ``ROLE=frontend`` runs no tritonserver: ready once ``/v1/models`` answers."""
        self.front.start_background()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.front_answers():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OpenAI front did not answer:\n{self.front.log_tail()}")
            time.sleep(0.2)

    def front_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.front_port}/v1/models", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def healthy(self) -> tuple[int, int]:
        """(prefill, decode) instances the router lists healthy; (0, 0) while it does not answer."""
        return healthy_instances(self.router.metrics_url)

    def whole(self) -> bool:
        return self.healthy() == self.size and self.front_answers()

    def wait_whole(self, timeout_s: float) -> float | None:
        """perf_counter when the fleet is whole again, None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.whole():
                return time.perf_counter()
            time.sleep(0.2)
        return None

    def kill_and_restart(self, victim: str) -> None:
        """SIGKILL ``victim`` (its whole process group) and start it again on the same ports."""
        self.note_stubs()
        if victim == "registry":
            self.registry.stop(kill=True)
            self.registry.start()
        elif victim == "front":
            self.front.kill()
            self.start_front()
        else:
            server = self.servers[victim]
            server.kill()
            server.start(READY_TIMEOUT_S)

    def note_stubs(self) -> None:
        for server in self.servers.values():
            self.stub_pids.update(server.stub_pids())

    def pages_in_use(self) -> dict[str, int | None]:
        """KV pages in use per worker server (None: its metrics endpoint did not answer)."""
        pages: dict[str, int | None] = {}
        for name, server in self.workers.items():
            per_instance = read_pages(server.metrics_url)
            pages[name] = None if per_instance is None else sum(per_instance.values())
        return pages

    def stop(self) -> dict[str, dict[str, Any]]:
        """SIGTERM the front, the router, then every worker; how each stop went."""
        self.note_stubs()
        stops: dict[str, dict[str, Any]] = {}
        self.front.stop(CLEAN_STOP_S)
        for name, server in self.servers.items():   # the router first: it stops sending to the workers
            # a stop slower than a clean one has its stubs dump their stacks into its log (where it waits)
            seconds, killed = server.stop(40.0, dump_after_s=CLEAN_STOP_S)
            stops[name] = {"seconds": round(seconds, 1), "killed": killed,
                           "clean": not killed and seconds <= CLEAN_STOP_S}
            if not stops[name]["clean"]:
                print(f"--- {name}: unclean stop; the end of "
                      f"{server.log_path}:\n{server.log_tail(12000)}\n---",
                      flush=True)
        self.registry.stop()
        return stops


@dataclass
class ChaosRun:
    fleet: ChaosFleet
    interval_s: float
    heal_bound_s: float
    rng: random.Random
    kills: list[Kill] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def loop(self) -> None:
        """The chaos thread: kill, restart, wait for the fleet to be whole, until ``stop``."""
        victims = ("registry", "router", "front", *self.fleet.workers)
        while not self.stop.wait(self.interval_s):
            victim = self.rng.choice(victims)
            kill = Kill(victim, time.perf_counter())
            self.kills.append(kill)
            logger.info("kill -9 %s", victim)
            try:
                self.fleet.kill_and_restart(victim)
            except (RuntimeError, TimeoutError) as exc:
                logger.error("%s did not come back: %s", victim, exc)
                return
            kill.healed_s = self.fleet.wait_whole(max(self.heal_bound_s * 2, 60.0))
            logger.info("%s: fleet whole again after %s s", victim,
                        None if kill.heal_seconds is None else round(kill.heal_seconds, 1))


def in_a_kill_window(record_s: tuple[float, float], kills: list[Kill], grace_s: float) -> bool:
    """Whether a request (sent, ended) overlapped a kill's window: the kill to the fleet whole again +
    grace."""
    sent_s, end_s = record_s
    for kill in kills:
        window_end = (kill.healed_s or float("inf")) + grace_s
        if sent_s <= window_end and end_s >= kill.killed_s:
            return True
    return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--kill-interval-s", type=float, default=60.0)
    p.add_argument("--heal-bound-s", type=float, default=30.0,
                   help="a kill must be healed within this (raised to 1.5x the slowest server start seen)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prefills", type=int, default=2, help="prefill servers")
    p.add_argument("--decodes", type=int, default=2, help="decode servers")
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--request-timeout-s", type=float, default=330.0,
                   help="the client's deadline per request: past the router's 300 s idle timeout, so a "
                        "silent "
                   "stream gets the router's error first")
    p.add_argument("--window-grace-s", type=float, default=10.0,
                   help="an error this long after a heal still counts as the kill's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-backend", choices=("nixl", "mooncake"), default="",
                   help="the workers' KV backend (default: model_repository's, nixl)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "artifacts" / "bench_chaos")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parse_args(argv)
    fleet = ChaosFleet(args.log_dir, args.prefills, args.decodes, args.kv_backend)
    try:
        fleet.start()
    except (RuntimeError, TimeoutError) as exc:
        logger.error("the fleet did not start: %s", exc)
        fleet.stop()
        return 2
    start_s = max(s.start_seconds for s in fleet.servers.values())
    heal_bound_s = max(args.heal_bound_s, 1.5 * start_s)
    workload = SoakWorkload(max_new_tokens=args.max_new_tokens, cancel_fraction=args.cancel_fraction,
                            seed=args.seed)
    cfg = SoakConfig(model="pd_ensemble", url=fleet.router.grpc_url, metrics_url=fleet.router.metrics_url,
                     launch=True, models="", duration_s=args.duration_s, drain_s=args.request_timeout_s,
                     request_timeout_s=args.request_timeout_s, pages_wait_s=0.0, concurrency=args.concurrency,
                     progress_s=30.0, workload=workload, out=None, log_dir=args.log_dir)
    chaos = ChaosRun(fleet, args.kill_interval_s, heal_bound_s, random.Random(args.seed))
    thread = threading.Thread(target=chaos.loop, name="chaos", daemon=True)
    run = SoakRun(cfg, cfg.url, cfg.metrics_url, None)
    thread.start()
    try:
        duration_s = asyncio.run(run.run())
    finally:
        chaos.stop.set()
        thread.join(READY_TIMEOUT_S)
    fleet.wait_whole(heal_bound_s)
    deadline = time.monotonic() + 30.0
    pages = fleet.pages_in_use()
    while any(p != 0 for p in pages.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
        pages = fleet.pages_in_use()
    stops = fleet.stop()
    kernel = kernel_log()
    faults = [] if kernel is None else fault_lines(kernel, sorted(fleet.stub_pids))

    summary = summarize(run.records, duration_s, sum(p or 0 for p in pages.values()), [])
    errors = [r for r in run.records if r.outcome is Outcome.ERROR]
    outside = [r for r in errors if not in_a_kill_window(
        (r.record.sent_s, r.ended_s), chaos.kills, args.window_grace_s)]
    heals = [k.heal_seconds for k in chaos.kills if k.heal_seconds is not None]
    summary.update(
        kills=[{"victim": k.victim, "heal_s": None if k.heal_seconds is None else round(k.heal_seconds, 1)}
               for k in chaos.kills],
        heal_p50_s=round(percentile(heals, 50), 1) if heals else None,
        heal_max_s=round(max(heals), 1) if heals else None, heal_bound_s=round(heal_bound_s, 1),
        errors_outside_kill_windows=len(outside),
        errors_outside_examples=sorted({classify_error(r.error or "") + ": " + (r.error or "")[:160]
                                        for r in outside})[:5],
        pages_by_worker=pages, stops=stops, stub_faults=faults,
        load_avg=[round(v, 2) for v in os.getloadavg()])
    failed = []
    if summary["streams_without_final"]:
        failed.append(f"{summary['streams_without_final']} streams without FINAL")
    if any(p != 0 for p in pages.values()):
        failed.append(f"KV pages not returned: {pages}")
    if outside:
        failed.append(f"{len(outside)} errors outside any kill window")
    if len(heals) < len(chaos.kills) or any(h > heal_bound_s for h in heals):
        failed.append(f"a kill not healed within {heal_bound_s:.0f} s: {summary['kills']}")
    if not all(s["clean"] for s in stops.values()):
        failed.append(f"unclean stops: {stops}")
    if faults:
        failed.append(f"stubs killed by a fault: {faults}")
    summary["failures"] = failed
    print(f"chaos: {duration_s:.0f} s, concurrency {args.concurrency}, {len(chaos.kills)} kills "
          f"({', '.join(k.victim for k in chaos.kills)})")
    print(f"  requests sent {summary['requests_sent']}, ok {summary['completed_ok']}, cancelled "
          f"{summary['cancelled']}, errors {summary['errors']} {summary['errors_by_kind']}, timed out while "
          f"streaming {summary['timed_out_streaming']}")
    print(f"  errors outside kill windows {len(outside)} (must be 0), streams without FINAL "
          f"{summary['streams_without_final']} (must be 0), pages not returned {pages} (must be 0)")
    print(f"  heal p50 {summary['heal_p50_s']} s, max {summary['heal_max_s']} s (bound {heal_bound_s:.0f} "
          f"s); stops {stops}; stub faults {len(faults)}")
    print("FAIL: " + "; ".join(failed) if failed else "PASS", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(json.dumps(summary, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
