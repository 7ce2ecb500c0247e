"""The pairing benchmark's pure parts: a skewed 2P2D repository, its router variants, selection counts,
figures.

One tritonserver serves the whole fleet (``prefill``, ``prefill_1``, ``decode``, ``decode_1``; ``decode_1``
with far fewer KV pages) and one router model per policy under test (``pd_ensemble`` copies with another name
and other ``policy`` / ``direct_decode_max_tokens``). Every router discovers the same four instances at the
bootstrap service, so the runs differ only in the router the client calls; they run one after the other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf.server import REPO_ROOT, _override_parameters
from perf.stats import RequestRecord, Slo, percentile, run_duration_s, summarize

# bench_serving.py's goodput SLO (perf.bench_run.BenchConfig defaults; a unit test keeps them equal)
SERVING_SLO = Slo(ttft_ms=4000.0, itl_p99_ms=250.0)
SELECTIONS = "pd_router_selections_total"


@dataclass(frozen=True)
class RouterVariant:
    """One router model of the repository: ``model`` (a ``pd_ensemble`` copy) with its pairing knobs."""

    model: str
    policy: str
    direct_decode_max_tokens: int = 0


@dataclass(frozen=True)
class FleetSpec:
    """The skewed fleet: every instance alike except ``decode_1``'s KV pool.

    Attributes:
        decode_pages: ``num_pages`` of ``decode`` (16 tokens a page).
        small_decode_pages: ``num_pages`` of ``decode_1``.
        prefill_cpus / decode_cpus: cores both prefill stubs / both decode stubs are pinned to.
    """

    decode_pages: int = 1024
    small_decode_pages: int = 64
    prefill_cpus: tuple[int, ...] = (0,)
    decode_cpus: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if not 0 < self.small_decode_pages <= self.decode_pages:
            raise ValueError(f"need 0 < small_decode_pages <= decode_pages, got {self}")

    @property
    def cpus(self) -> dict[str, tuple[int, ...]]:
        """Engine model → cores of its stub."""
        return {"prefill": self.prefill_cpus, "prefill_1": self.prefill_cpus,
                "decode": self.decode_cpus, "decode_1": self.decode_cpus}


def _renamed(config: str, src: str, dest: str) -> str:
    pattern = re.compile(r'^name:\s*"' + re.escape(src) + r'"', re.MULTILINE)
    if not pattern.search(config):
        raise ValueError(f"config.pbtxt of {src} has no name line")
    return pattern.sub(f'name: "{dest}"', config, count=1)


def model_configs(fleet: FleetSpec, routers: Sequence[RouterVariant],
                  sources: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Model name → (source model folder, its config.pbtxt text) of the benchmark repository.

    ``sources`` maps ``prefill`` / ``decode`` / ``pd_ensemble`` to their config text in ``model_repository/``.
    """
    engine = {"num_threads": "1"}
    wanted = {"prefill": ("prefill", engine), "prefill_1": ("prefill", engine),
              "decode": ("decode", {**engine, "num_pages": str(fleet.decode_pages)}),
              "decode_1": ("decode", {**engine, "num_pages": str(fleet.small_decode_pages)})}
    for r in routers:
        wanted[r.model] = ("pd_ensemble", {"policy": r.policy,
                                           "direct_decode_max_tokens": str(r.direct_decode_max_tokens)})
    if len(wanted) != 4 + len(routers):
        raise ValueError(f"router model names must be distinct and not engine names: {routers}")
    return {name: (src, _override_parameters(_renamed(sources[src], src, name), over))
            for name, (src, over) in wanted.items()}


def build_fleet_repository(fleet: FleetSpec, routers: Sequence[RouterVariant], dest: Path) -> Path:
    """Write ``dest``: one folder per model, ``1/`` linked to its source in ``model_repository/``."""
    sources = {m: (REPO_ROOT / "model_repository" / m / "config.pbtxt").read_text()
               for m in ("prefill", "decode", "pd_ensemble")}
    for name, (src, config) in model_configs(fleet, routers, sources).items():
        (dest / name).mkdir(parents=True)
        (dest / name / "1").symlink_to(REPO_ROOT / "model_repository" / src / "1", target_is_directory=True)
        (dest / name / "config.pbtxt").write_text(config)
    return dest


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def selections(metrics: Mapping[str, float], router_model: str) -> dict[str, dict[str, float]]:
    """``pd_router_selections_total`` of ``router_model`` as {role: {target: count}} (scraped key → value)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if not key.startswith(SELECTIONS + "{"):
            continue
        labels = dict(_LABEL.findall(key))
        if labels.get("model") != router_model:
            continue
        role, target = labels.get("role", "?"), labels.get("target", "?")
        out.setdefault(role, {})[target] = out.get(role, {}).get(target, 0.0) + value
    return out


def selection_delta(before: Mapping[str, Mapping[str, float]],
                    after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, int]]:
    """Per role and target, selections made between two ``selections`` readings (zeros dropped)."""
    out: dict[str, dict[str, int]] = {}
    for role, targets in after.items():
        for target, count in targets.items():
            delta = int(round(count - before.get(role, {}).get(target, 0.0)))
            if delta:
                out.setdefault(role, {})[target] = delta
    return out


def run_figures(records: Sequence[RequestRecord], slo: Slo) -> dict[str, float]:
    """``perf.stats.summarize`` of one run plus TPOT p50/p99 (per request: (last token - first) / (n - 1),
    ms)."""
    duration_s = run_duration_s(records)
    figures = summarize(records, duration_s, slo) if duration_s > 0 else {"num_requests": float(len(records))}
    tpots = [(r.token_times_s[-1] - r.token_times_s[0]) * 1e3 / (len(r.token_times_s) - 1)
             for r in records if r.ok and len(r.token_times_s) > 1]
    figures["tpot_p50_ms"] = percentile(tpots, 50)
    figures["tpot_p99_ms"] = percentile(tpots, 99)
    figures["num_met_slo"] = float(sum(slo.met_by(r) for r in records))
    return figures


def pooled(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    """Mean of ``key`` over repeated runs of one variant (NaN when none has it)."""
    values = [float(r[key]) for r in runs if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``; None when the denominator is 0 or either is NaN."""
    if denominator == 0 or numerator != numerator or denominator != denominator:
        return None
    return numerator / denominator


def alternating(first: str, second: str, repeats: int) -> list[str]:
    """ABBA order (A B B A A B ...) of ``repeats`` runs each, so a slow drift of the machine hits both
    alike."""
    order: list[str] = []
    for i in range(repeats):
        order += [first, second] if i % 2 == 0 else [second, first]
    return order
