"""Serving benchmark: PD disaggregated (``pd_ensemble``) against co-located (``colocated``), same request
stream.

For each deployment, one after the other (never concurrently, so they do not share the CPU), the script starts
its own tritonserver on loopback ports (``--port-base``), pins the model stubs to cores, and runs:

1. workload (i), chat-like: prompts of ~256 tokens, 64 new tokens, closed loop at concurrency 1, 2, 4, 8;
2. workload (ii), interference: decode-heavy streams (32-token prompts, 128 new tokens) kept busy while long
   prompts (~2048 tokens) arrive at a fixed interval;
3. transfer share (PD only): one request at a time per prompt length; KV transfer seconds from the server's
   metrics (``pd_kv_transfer_seconds_total`` / ``pd_kv_transfers_total``) divided by that request's TTFT.

Every request sets ``ignore_eos`` and ``temperature=0``, so each generates exactly ``max_tokens`` tokens.
It writes ``docs/bench_serving.json`` and ``docs/bench_chat.png`` / ``docs/bench_interference.png``, and
prints one JSON line last. Usage::

    .venv/bin/python scripts/bench_serving.py              # full run (~15-25 min on 2 cores)
    .venv/bin/python scripts/bench_serving.py --quick      # < 3 min, smaller workloads
    .venv/bin/python scripts/bench_serving.py --models colocated
    .venv/bin/python scripts/bench_serving.py --models pd_ensemble,pd_hosts   # root: PD on one host vs three

``pd_hosts`` is the ``pd_ensemble`` deployment with the router, prefill and decode servers each on its own
network host (``scripts/fleet/serve_hosts.py``: namespaces on a bridge, the README's "Across servers"
commands, KV over TCP on the veth links); the final line then adds its ratios against the one-host ``pd`` run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf.bench_run import (  # noqa: E402 - needs scripts/ on sys.path
    BenchConfig,
    deployments_for,
    final_line,
    run_deployment,
)
from perf.plots import plot_chat, plot_interference  # noqa: E402

logger = logging.getLogger("bench_serving")
REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """The one place the CLI becomes a ``BenchConfig``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small workloads, whole run < 3 min")
    p.add_argument("--models", default="pd_ensemble,colocated",
                   help="deployments to compare, comma-separated (pd_ensemble, colocated, pd_hosts)")
    p.add_argument("--concurrency", default=None, help="chat concurrencies, e.g. 1,2,4,8")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput bound on TTFT (ms)")
    p.add_argument("--slo-itl-p99-ms", type=float, default=None,
                   help="goodput bound on a request's ITL p99 (ms)")
    p.add_argument("--colo-threads", type=int, default=2, help="torch threads of the colocated engine")
    p.add_argument("--port-base", type=int, default=18600, help="ports port-base .. port-base+29 are used")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request still open after this fails")
    p.add_argument("--out-json", type=Path, default=REPO_ROOT / "docs" / "bench_serving.json")
    p.add_argument("--plot-dir", type=Path, default=REPO_ROOT / "docs")
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "artifacts" / "bench_serving")
    a = p.parse_args(argv)
    conc = tuple(int(c) for c in a.concurrency.split(",")) if a.concurrency else None
    return BenchConfig.make(quick=a.quick, models=tuple(m.strip() for m in a.models.split(",") if m.strip()),
                            concurrencies=conc, slo_ttft_ms=a.slo_ttft_ms, slo_itl_p99_ms=a.slo_itl_p99_ms,
                            colo_threads=a.colo_threads, port_base=a.port_base, seed=a.seed,
                            out_json=a.out_json, plot_dir=a.plot_dir, log_dir=a.log_dir,
                            request_timeout_s=a.request_timeout_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    cfg = parse_config(argv)
    # SIGTERM unwinds like Ctrl-C, so the servers this run started are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    results: dict[str, Any] = {}
    series: dict[str, Any] = {}
    windows: dict[str, Any] = {}
    for deployment in deployments_for(cfg):
        try:
            outcome = run_deployment(cfg, deployment)
        # one deployment failing (e.g. not in the repo yet) is reported
        except (RuntimeError, OSError) as exc:
            logger.error("%s failed: %s (server log in %s)", deployment.name, exc, cfg.log_dir)
            results[deployment.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        results[deployment.name] = outcome.summary
        series[deployment.name] = outcome.itl_series
        windows[deployment.name] = outcome.long_windows
    doc: dict[str,
              Any] = {"config": asdict(cfg) | {"out_json": str(cfg.out_json), "plot_dir": str(cfg.plot_dir),
                                     "log_dir": str(cfg.log_dir)},
           "conditions": {"cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
                          "started_unix_s": started, "wall_s": time.time() - started},
           "results": results}
    line = final_line(results)
    doc["summary"] = line
    cfg.out_json.parent.mkdir(parents=True, exist_ok=True)
    # the figures first: a plot may fail
    cfg.out_json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    cfg.plot_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    if any("chat" in r for r in results.values()):
        plots.append(str(plot_chat(results, cfg.concurrencies, cfg.plot_dir / f"bench_chat{cfg.suffix}.png")))
    if any(series.values()):
        plots.append(str(plot_interference(series, windows,
                                           cfg.plot_dir / f"bench_interference{cfg.suffix}.png")))
    doc["plots"] = plots
    cfg.out_json.parent.mkdir(parents=True, exist_ok=True)
    cfg.out_json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
