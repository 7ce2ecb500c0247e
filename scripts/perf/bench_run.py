"""One deployment's benchmark run: start its server, run the phases, summarize. Used by bench_serving.py."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perf.server import Deployment, RunningServer, ServerPorts, scrape_metrics
from perf.stats import RequestRecord, Slo, percentile, run_duration_s, summarize
from perf.stream_client import run_phase_sync
from perf.workload import InterferenceConfig, Phase, RequestSpec, chat_phase, interference_phase, make_prompt

if TYPE_CHECKING:
    from fleet.serve_hosts import HostsServer

logger = logging.getLogger(__name__)

TRANSFER_SECONDS = "pd_kv_transfer_seconds_total"
TRANSFER_TAIL_SECONDS = "pd_kv_transfer_tail_seconds_total"
TRANSFERS = "pd_kv_transfers_total"
TRANSFER_BYTES = "pd_kv_transfer_bytes_total"


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run depends on (recorded in the result JSON).

    SLO defaults (ms): TTFT <= 4000 — a ~256-token prefill takes ~0.8 s on one core, so 4 s leaves room for
    queueing behind a few others but not for waiting out a whole batch; a request's ITL p99 <= 250 — one
    decode step of a small batch is ~60-120 ms on this CPU, 250 ms (4 tokens/s) is still faster than people
    read, while a step that carries a 512-token prefill chunk (~1.5 s) breaks it.
    """

    quick: bool
    models: tuple[str, ...]
    concurrencies: tuple[int, ...]
    chat_requests_per_slot: int
    chat_prompt_tokens: int
    chat_max_tokens: int
    interference: InterferenceConfig
    transfer_prompt_tokens: tuple[int, ...]
    slo_ttft_ms: float
    slo_itl_p99_ms: float
    colo_threads: int
    port_base: int
    seed: int
    out_json: Path
    plot_dir: Path
    log_dir: Path
    request_timeout_s: float = 600.0
    suffix: str = ""

    @classmethod
    def make(cls, *, quick: bool, models: tuple[str, ...], concurrencies: tuple[int, ...] | None,
             slo_ttft_ms: float | None, slo_itl_p99_ms: float | None, colo_threads: int, port_base: int,
             seed: int, out_json: Path, plot_dir: Path, log_dir: Path,
             request_timeout_s: float = 600.0) -> BenchConfig:
        """Full or quick sizes; a quick run writes next to the logs unless told otherwise."""
        if quick:
            inter = InterferenceConfig(num_decode_streams=2, decode_max_tokens=48, long_prompt_tokens=1024,
                                       long_max_tokens=4, num_long=2, long_interval_s=5.0, first_long_s=2.0)
            sizes: dict[str, Any] = dict(concurrencies=concurrencies or (1, 4), chat_requests_per_slot=1,
                                         chat_prompt_tokens=256, chat_max_tokens=16,
                                         transfer_prompt_tokens=(256, 1024))
            if out_json.parent == plot_dir:
                out_json, plot_dir = log_dir / "bench_serving_quick.json", log_dir
        else:
            inter = InterferenceConfig()
            sizes = dict(concurrencies=concurrencies or (1, 2, 4, 8), chat_requests_per_slot=3,
                         chat_prompt_tokens=256, chat_max_tokens=64,
                         transfer_prompt_tokens=(256, 512, 1024, 2048))
        return cls(quick=quick, models=models, interference=inter, slo_ttft_ms=slo_ttft_ms or 4000.0,
                   slo_itl_p99_ms=slo_itl_p99_ms or 250.0, colo_threads=colo_threads, port_base=port_base,
                   seed=seed, out_json=out_json, plot_dir=plot_dir, log_dir=log_dir,
                   request_timeout_s=request_timeout_s, **sizes)

    @property
    def slo(self) -> Slo:
        return Slo(ttft_ms=self.slo_ttft_ms, itl_p99_ms=self.slo_itl_p99_ms)


def deployments_for(cfg: BenchConfig) -> list[Deployment]:
    """PD: prefill on core 0, decode on core 1, one torch thread each; ``pd_hosts``: the same with router,
    prefill and decode each on its own network host (``fleet.serve_hosts.HostsServer``, root only); colocated:
    both cores, ``colo_threads``."""
    out = []
    for model in cfg.models:
        if model == "pd_ensemble":
            out.append(Deployment(name="pd", entry_model="pd_ensemble",
                                  models=("prefill", "decode", "pd_ensemble"),
                                  overrides={"prefill": {"num_threads": "1"}, "decode": {"num_threads": "1"}},
                                  cpus={"prefill": (0,), "decode": (1,)}))
        # the same PD deployment, router, prefill and decode on three network hosts
        elif model == "pd_hosts":
            out.append(Deployment(name="pd_hosts", entry_model="pd_ensemble",
                                  models=("prefill", "decode", "pd_ensemble"),
                                  overrides={"prefill": {"num_threads": "1"}, "decode": {"num_threads": "1"}},
                                  cpus={"prefill": (0,), "decode": (1,)}))
        elif model == "colocated":
            out.append(Deployment(name="colo", entry_model="colocated", models=("colocated",),
                                  overrides={"colocated": {"num_threads": str(cfg.colo_threads)}},
                                  cpus={"colocated": (0, 1)}))
        else:
            raise ValueError(f"unknown model {model!r} (pd_ensemble, colocated, pd_hosts)")
    return out


@dataclass
class DeploymentOutcome:
    """Summary figures plus the raw series the plots need."""

    summary: dict[str, Any] = field(default_factory=dict)
    itl_series: list[tuple[float, float]] = field(default_factory=list)  # (s since phase start, ITL ms)
    long_windows: list[tuple[float, float]] = field(default_factory=list)  # (start s, end s) of long requests


def _phase_summary(records: list[RequestRecord], slo: Slo,
                   kinds: tuple[str, ...] | None = None) -> dict[str, float]:
    chosen = [r for r in records if kinds is None or r.kind in kinds]
    duration_s = run_duration_s(records)
    return summarize(chosen, duration_s, slo) if chosen and duration_s > 0 else {"num_requests": 0.0}


def _run_interference(cfg: BenchConfig, server: RunningServer | HostsServer,
                      outcome: DeploymentOutcome) -> dict[str, Any]:
    inter = cfg.interference
    horizon_s = inter.first_long_s + inter.num_long * inter.long_interval_s + 120.0
    per_stream = max(2, math.ceil(horizon_s / max(1.0, inter.decode_max_tokens * 0.05)))
    phase = interference_phase(inter, per_stream, cfg.seed)
    records = run_phase_sync(server.ports.grpc_url, server.deployment.entry_model, phase,
                             cfg.request_timeout_s)
    start = min(r.sent_s for r in records)
    long_end = max((r.done_s or r.sent_s) for r in records if r.kind == "long")
    # decode ITLs that fall inside the window where long prompts arrive (first send .. last long done)
    for r in records:
        if r.kind == "decode" and r.ok:
            outcome.itl_series += [(t - start, gap) for t, gap in zip(r.token_times_s[1:], r.itls_ms)]
        if r.kind == "long":
            outcome.long_windows.append((r.sent_s - start, (r.done_s or r.sent_s) - start))
    in_window = [gap for t, gap in outcome.itl_series if t <= long_end - start]
    return {"decode": _phase_summary(records, cfg.slo, ("decode",)),
            "long": _phase_summary(records, cfg.slo, ("long",)),
            "decode_itl_in_window_p50_ms": percentile(in_window, 50),
            "decode_itl_in_window_p99_ms": percentile(in_window, 99),
            "decode_itl_in_window_max_ms": max(in_window) if in_window else float("nan"),
            "window_s": long_end - start, "num_decode_requests": sum(r.kind == "decode" for r in records)}


def _metric_sum(metrics: dict[str, float], name: str, model: str = "prefill") -> float | None:
    """Sum of the series of ``name`` labelled ``model="<model>"`` (the prefill side times transfers; counting
    the decode side's series too would count each room twice), else of all its series; None when absent."""
    series = {k: v for k, v in metrics.items() if k == name or k.startswith(name + "{")}
    own = [v for k, v in series.items() if f'model="{model}"' in k]
    return sum(own) if own else (sum(series.values()) if series else None)


def _run_transfer_share(cfg: BenchConfig, server: RunningServer | HostsServer) -> dict[str, Any]:
    """One request at a time per prompt length; transfer seconds from the metrics delta around it."""
    out: dict[str, Any] = {}
    for n in cfg.transfer_prompt_tokens:
        spec = RequestSpec(request_id=f"xfer-{n}", kind="transfer", prompt=make_prompt(n, cfg.seed + n),
                           num_prompt_tokens=n, max_tokens=2)
        before = scrape_metrics(server.ports.metrics_url)
        [record] = run_phase_sync(server.ports.grpc_url, server.deployment.entry_model,
                                  Phase(name=f"transfer_{n}", requests=(spec,)), cfg.request_timeout_s)
        time.sleep(1.5)  # Triton refreshes python-backend metrics on scrape; let the counters settle
        after = scrape_metrics(server.ports.metrics_url)
        row: dict[str, Any] = {"num_prompt_tokens": record.num_prompt_tokens,
                               "ttft_ms": record.ttft_ms if record.ok else None, "error": record.error}
        s0, s1 = _metric_sum(before, TRANSFER_SECONDS), _metric_sum(after, TRANSFER_SECONDS)
        c0, c1 = _metric_sum(before, TRANSFERS), _metric_sum(after, TRANSFERS)
        if None in (s0, s1, c0, c1) or not record.ok or c1 == c0:
            row["transfer_ms"] = None
            row["note"] = f"server exposes no {TRANSFER_SECONDS}/{TRANSFERS} metrics (pending)"
        else:
            # the metric spans first chunk posted -> last WRITE done, so with chunked prefill it includes the
            # compute of the later chunks that the transfer overlaps
            row["transfer_ms"] = (s1 - s0) / (c1 - c0) * 1e3  # type: ignore[operator]
            row["transfer_share_of_ttft"] = row["transfer_ms"] / record.ttft_ms
            t0, t1 = _metric_sum(before, TRANSFER_TAIL_SECONDS), _metric_sum(after, TRANSFER_TAIL_SECONDS)
            if t0 is not None and t1 is not None:
                # the tail (last chunk posted → last WRITE done) is what no prefill compute hides; the first
                # token reaches the client before it, the second token waits for it
                row["transfer_tail_ms"] = (t1 - t0) / (c1 - c0) * 1e3
                row["transfer_tail_share_of_ttft"] = row["transfer_tail_ms"] / record.ttft_ms
            b0, b1 = _metric_sum(before, TRANSFER_BYTES), _metric_sum(after, TRANSFER_BYTES)
            row["transfer_bytes"] = None if b0 is None or b1 is None else (
                b1 - b0) / (c1 - c0)  # type: ignore[operator]
        out[str(n)] = row
    return out


def run_deployment(cfg: BenchConfig, deployment: Deployment) -> DeploymentOutcome:
    """Start the deployment's server (or, ``pd_hosts``, its fleet of hosts), warm it up, run every phase, stop
    it."""
    index = cfg.models.index(deployment.name if deployment.name == "pd_hosts" else deployment.entry_model)
    base = cfg.port_base + 10 * index
    outcome = DeploymentOutcome()
    outcome.summary["loadavg_1m_before"] = os.getloadavg()[0]  # other work on the machine skews figures
    server: RunningServer | HostsServer
    if deployment.name == "pd_hosts":
        from fleet.serve_hosts import HostsServer

        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        server = HostsServer(deployment, cfg.log_dir)
    else:
        server = RunningServer(deployment, ServerPorts(http=base, grpc=base + 1, metrics=base + 2),
                               cfg.log_dir)
    with server:
        ports = server.ports
        outcome.summary["pinned_cpus"] = server.pinned
        warm = chat_phase(1, 2, 32, 4, seed=cfg.seed + 999)
        run_phase_sync(ports.grpc_url, deployment.entry_model, warm, cfg.request_timeout_s)
        chat: dict[str, Any] = {}
        for c in cfg.concurrencies:
            phase = chat_phase(c, c * cfg.chat_requests_per_slot, cfg.chat_prompt_tokens, cfg.chat_max_tokens,
                               cfg.seed)
            records = run_phase_sync(ports.grpc_url, deployment.entry_model, phase, cfg.request_timeout_s)
            server.check_alive(phase.name)
            chat[str(c)] = _phase_summary(records, cfg.slo)
            logger.info("%s chat c=%d: %s", deployment.name, c, chat[str(c)])
        outcome.summary["chat"] = chat
        outcome.summary["interference"] = _run_interference(cfg, server, outcome)
        server.check_alive("interference")
        logger.info("%s interference: %s", deployment.name, outcome.summary["interference"])
        if deployment.name in ("pd", "pd_hosts"):
            outcome.summary["transfer_share"] = _run_transfer_share(cfg, server)
            server.check_alive("transfer share")
    outcome.summary["loadavg_1m_after"] = os.getloadavg()[0]
    return outcome


def final_line(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures (workload ii): decode ITL p99 and long-prompt TTFT p50 per deployment, and the
    target ratios PD/colocated (ITL <= 0.5, TTFT <= 1.3)."""
    line: dict[str, Any] = {}
    for name in ("pd", "colo"):
        inter = results.get(name, {}).get("interference", {})
        line[f"{name}_itl_p99_ms"] = inter.get("decode", {}).get("itl_p99_ms")
        line[f"{name}_ttft_p50_ms"] = inter.get("long", {}).get("ttft_p50_ms")
        line[f"{name}_decode_ttft_p50_ms"] = inter.get("decode", {}).get("ttft_p50_ms")
    if line["pd_itl_p99_ms"] and line["colo_itl_p99_ms"]:
        line["itl_p99_ratio_pd_over_colo"] = line["pd_itl_p99_ms"] / line["colo_itl_p99_ms"]
        line["itl_target_met"] = line["itl_p99_ratio_pd_over_colo"] <= 0.5
    if line["pd_ttft_p50_ms"] and line["colo_ttft_p50_ms"]:
        line["ttft_p50_ratio_pd_over_colo"] = line["pd_ttft_p50_ms"] / line["colo_ttft_p50_ms"]
        line["ttft_target_met"] = line["ttft_p50_ratio_pd_over_colo"] <= 1.3
    hosts = results.get("pd_hosts", {})
    if hosts.get("interference"):
        # across hosts against the one-host PD run: the network's cost (>1: slower across hosts)
        inter = hosts["interference"]
        line["pd_hosts_itl_p99_ms"] = inter.get("decode", {}).get("itl_p99_ms")
        line["pd_hosts_ttft_p50_ms"] = inter.get("long", {}).get("ttft_p50_ms")
        for key in ("itl_p99_ms", "ttft_p50_ms"):
            if line.get(f"pd_{key}") and line.get(f"pd_hosts_{key}"):
                ratio = line[f"pd_hosts_{key}"] / line[f"pd_{key}"]
                line[f"{key.rsplit('_', 1)[0]}_ratio_hosts_over_one_host"] = ratio
        chat_one, chat_hosts = results.get("pd", {}).get("chat", {}), hosts.get("chat", {})
        for c in sorted(set(chat_one) & set(chat_hosts), key=int):
            one, across = chat_one[c].get("ttft_p50_ms"), chat_hosts[c].get("ttft_p50_ms")
            if one and across:
                line[f"chat_c{c}_ttft_p50_ratio_hosts_over_one_host"] = across / one
    return line
