"""Pairing benchmark: load-aware against round-robin pairing on a skewed 2P2D fleet, and direct decode of
short prompts against prefill + transfer.

One tritonserver (``scripts/serve.sh`` on free loopback ports, with its bootstrap service) serves ``prefill``,
``prefill_1`` (both pinned to core 0), ``decode`` and ``decode_1`` (both pinned to core 1; ``decode_1`` has
``--small-decode-pages`` KV pages against ``--decode-pages``), and three routers that find those four at the
bootstrap service: ``pd_ensemble`` (load_aware), ``pd_ensemble_rr`` (round_robin) and ``pd_ensemble_dd``
(load_aware, ``direct_decode_max_tokens``). Same fleet processes for every run; runs alternate A B B A.

1. skew: ``--requests`` requests of ``--prompt-tokens`` + ``--max-tokens`` tokens in a closed loop at
   ``--concurrency``, same seeded prompts for both policies; goodput under bench_serving.py's SLO (TTFT <= 4
   s, a request's ITL p99 <= 250 ms), TTFT / TPOT / ITL p50 and p99, and each router's selections per instance
   (``pd_router_selections_total``), per run and pooled;
2. direct decode: ``--short-requests`` prompts of ``--short-prompt-tokens`` (< ``--direct-max-tokens``)
through
   ``pd_ensemble_dd`` (decode prefills them itself) against ``pd_ensemble`` (prefill, then KV transfer).

Prints one JSON line last (``--out`` writes the whole result). The server is stopped on every exit path.

    .venv/bin/python scripts/bench_pairing.py --out artifacts/bench_pairing/bench_pairing.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf.pairing import (  # noqa: E402 - needs scripts/ on sys.path
    SERVING_SLO,
    FleetSpec,
    RouterVariant,
    alternating,
    build_fleet_repository,
    pooled,
    ratio,
    run_figures,
    selection_delta,
    selections,
)
from perf.server import REPO_ROOT, ServeScript, pin_process, scrape_metrics, stub_pids  # noqa: E402
from perf.stats import Slo  # noqa: E402
from perf.stream_client import run_phase_sync  # noqa: E402
from perf.workload import Phase, chat_phase  # noqa: E402

logger = logging.getLogger("bench_pairing")
LOAD_AWARE, ROUND_ROBIN, DIRECT = "pd_ensemble", "pd_ensemble_rr", "pd_ensemble_dd"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-pages", type=int, default=1024, help="KV pages of decode (16 tokens each)")
    p.add_argument("--small-decode-pages", type=int, default=64,
                   help="KV pages of decode_1 (64: two requests of 256 + 128 tokens)")
    p.add_argument("--requests", type=int, default=18, help="requests per skew run")
    p.add_argument("--concurrency", type=int, default=6,
                   help="closed-loop slots (6: one decode batch of 6 stays under the ITL bound)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs per policy (alternating A B B A)")
    p.add_argument("--direct-max-tokens", type=int, default=64,
                   help="direct_decode_max_tokens of pd_ensemble_dd")
    p.add_argument("--short-requests", type=int, default=16)
    p.add_argument("--short-concurrency", type=int, default=4)
    p.add_argument("--short-prompt-tokens", type=int, default=32)
    p.add_argument("--short-max-tokens", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=SERVING_SLO.ttft_ms)
    p.add_argument("--slo-itl-p99-ms", type=float, default=SERVING_SLO.itl_p99_ms)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=180.0)
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "artifacts" / "bench_pairing")
    p.add_argument("--out", type=Path, default=None, help="write the full result JSON here")
    a = p.parse_args(argv)
    if a.short_prompt_tokens >= a.direct_max_tokens:
        p.error("--short-prompt-tokens must be below --direct-max-tokens (else nothing goes direct)")
    return a


def _tagged(phase: Phase, tag: str) -> Phase:
    """The same requests with run-unique ids."""
    return Phase(phase.name,
                 tuple(dataclasses.replace(r, request_id=f"{tag}-{r.request_id}") for r in phase.requests))


def _run(server: ServeScript, router: str, phase: Phase, tag: str, slo: Slo,
         timeout_s: float) -> dict[str, Any]:
    """One measured run through ``router``: figures, selections per instance, load average before it."""
    load_1m = os.getloadavg()[0]
    before = selections(scrape_metrics(server.metrics_url), router)
    records = run_phase_sync(server.grpc_url, router, _tagged(phase, tag), timeout_s)
    time.sleep(1.5)  # Triton refreshes python-backend metrics on scrape; let the counters settle
    picked = selection_delta(before, selections(scrape_metrics(server.metrics_url), router))
    if server.stub_pids() == []:
        raise RuntimeError(f"server died during {tag} (log: {server.log_path})")
    figures = run_figures(records, slo)
    errors = sorted({r.error for r in records if r.error})[:3]
    out = {"router": router, "loadavg_1m_before": load_1m, **figures, "selections": picked, "errors": errors}
    logger.info("%s: %s", tag, json.dumps(out))
    return out


def _pin(server: ServeScript, repo: Path, fleet: FleetSpec) -> dict[str, list[int]]:
    pinned: dict[str, list[int]] = {}
    for model, cpus in fleet.cpus.items():
        for pid in stub_pids(repo / model):
            pin_process(pid, cpus)
            pinned[model] = sorted(os.sched_getaffinity(pid))
    if set(pinned) != set(fleet.cpus):
        raise RuntimeError(f"stubs not found for {set(fleet.cpus) - set(pinned)}")
    return pinned


def _summary(skew: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, Any]:
    la = [r for r in skew if r["router"] == LOAD_AWARE]
    rr = [r for r in skew if r["router"] == ROUND_ROBIN]
    line: dict[str, Any] = {}
    for name, runs in (("load_aware", la), ("round_robin", rr)):
        for key in ("goodput_requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                    "itl_p99_ms", "num_failed"):
            line[f"{name}_{key}"] = pooled(runs, key)
    line["goodput_ratio_load_aware_over_round_robin"] = ratio(line["load_aware_goodput_requests_per_s"],
                                                              line["round_robin_goodput_requests_per_s"])
    for name, runs in (("load_aware", la), ("round_robin", rr)):
        line[f"{name}_met_slo_of_requests"] = f"{sum(int(r.get('num_met_slo', 0)) for r in runs)}/" \
                                              f"{sum(int(r.get('num_requests', 0)) for r in runs)}"
    goodput_ratio = line["goodput_ratio_load_aware_over_round_robin"]
    # round robin at zero goodput: any load-aware goodput is an unbounded ratio (JSON has no infinity)
    line["goodput_target_met"] = (goodput_ratio >= 1.3 if goodput_ratio is not None
                                  else line["load_aware_goodput_requests_per_s"] > 0
                                  and line["round_robin_goodput_requests_per_s"] == 0)
    on = [r for r in direct if r["router"] == DIRECT]
    off = [r for r in direct if r["router"] == LOAD_AWARE]
    line["short_ttft_p50_ms_direct"] = pooled(on, "ttft_p50_ms")
    line["short_ttft_p50_ms_via_prefill"] = pooled(off, "ttft_p50_ms")
    line["short_ttft_p50_ratio_direct_over_prefill"] = ratio(line["short_ttft_p50_ms_direct"],
                                                             line["short_ttft_p50_ms_via_prefill"])
    return line


def run(a: argparse.Namespace) -> dict[str, Any]:
    fleet = FleetSpec(decode_pages=a.decode_pages, small_decode_pages=a.small_decode_pages)
    routers = [RouterVariant(LOAD_AWARE, "load_aware"), RouterVariant(ROUND_ROBIN, "round_robin"),
               RouterVariant(DIRECT, "load_aware", a.direct_max_tokens)]
    slo = Slo(ttft_ms=a.slo_ttft_ms, itl_p99_ms=a.slo_itl_p99_ms)
    skew_phase = chat_phase(a.concurrency, a.requests, a.prompt_tokens, a.max_tokens, a.seed)
    short_phase = chat_phase(a.short_concurrency, a.short_requests, a.short_prompt_tokens, a.short_max_tokens,
                             a.seed + 1)
    doc: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                           "fleet": dataclasses.asdict(fleet),
                           "routers": [dataclasses.asdict(r) for r in routers],
                           "slo": dataclasses.asdict(slo), "cpus": os.cpu_count(),
                           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                                    capture_output=True, text=True).stdout.strip()}
    with tempfile.TemporaryDirectory(prefix="bench-pairing-") as tmp:
        repo = build_fleet_repository(fleet, routers, Path(tmp) / "models")
        server = ServeScript(",".join(sorted(p.name for p in repo.iterdir())), a.log_dir / "serve.log",
                             model_repository=repo)
        started = time.monotonic()
        try:
            server.start(a.ready_timeout_s)
            doc["startup_s"] = time.monotonic() - started
            doc["pinned_cpus"] = _pin(server, repo, fleet)
            time.sleep(2.0)  # every instance heartbeats its load and every router reads the fleet
            warm = chat_phase(2, 4, 32, 4, a.seed + 999)
            for router in (ROUND_ROBIN, LOAD_AWARE, DIRECT):  # tokenizers, NIXL handshakes of every pair
                run_phase_sync(server.grpc_url, router, _tagged(warm, f"warm-{router}"), a.request_timeout_s)
            skew = [_run(server, router, skew_phase, f"skew{i}-{router}", slo, a.request_timeout_s)
                    for i, router in enumerate(alternating(LOAD_AWARE, ROUND_ROBIN, a.repeats))]
            direct = [_run(server, router, short_phase, f"short{i}-{router}", slo, a.request_timeout_s)
                      for i, router in enumerate(alternating(DIRECT, LOAD_AWARE, a.repeats))]
        finally:
            stop_s, killed = server.stop(60.0)
            logger.info("server stopped in %.1f s (SIGKILL: %s)", stop_s, killed)
    doc.update(skew=skew, direct=direct, summary=_summary(skew, direct), wall_s=time.monotonic() - started)
    return doc


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    a = parse_args(argv)
    # unwinds through the finally that stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    doc = run(a)
    for r in doc["skew"] + doc["direct"]:
        print(json.dumps({k: r[k] for k in ("router", "goodput_requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                             "tpot_p50_ms", "tpot_p99_ms", "num_failed", "selections")}))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
