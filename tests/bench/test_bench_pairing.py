"""The pairing benchmark's pure logic (scripts/perf/pairing.py, scripts/bench_pairing.py): repository,
selection counts, figures, run order. No server."""

from __future__ import annotations

import math
from pathlib import Path

import bench_pairing
import pytest
from perf.bench_run import BenchConfig
from perf.pairing import (
    SERVING_SLO,
    FleetSpec,
    RouterVariant,
    alternating,
    build_fleet_repository,
    model_configs,
    ratio,
    run_figures,
    selection_delta,
    selections,
)
from perf.stats import RequestRecord

ROUTERS = (RouterVariant("pd_ensemble", "load_aware"), RouterVariant("pd_ensemble_rr", "round_robin"),
           RouterVariant("pd_ensemble_dd", "load_aware", 64))


def test_slo_is_the_one_bench_serving_uses() -> None:
    cfg = BenchConfig.make(quick=False, models=("pd_ensemble",), concurrencies=None, slo_ttft_ms=None,
                           slo_itl_p99_ms=None, colo_threads=2, port_base=18600, seed=0,
                           out_json=Path("/tmp/x.json"), plot_dir=Path("/tmp/p"), log_dir=Path("/tmp/l"))
    assert cfg.slo == SERVING_SLO


def test_repository_holds_2p2d_with_a_small_decode_and_one_router_per_variant(tmp_path: Path) -> None:
    repo = build_fleet_repository(FleetSpec(decode_pages=1024, small_decode_pages=128), ROUTERS,
                                  tmp_path / "m")
    names = sorted(p.name for p in repo.iterdir())
    assert names == ["decode", "decode_1", "pd_ensemble", "pd_ensemble_dd", "pd_ensemble_rr", "prefill",
                     "prefill_1"]
    for name in names:
        config = (repo / name / "config.pbtxt").read_text()
        assert f'name: "{name}"\n' in config, name
        assert (repo / name / "1" / "model.py").is_file(), name
    assert 'key: "num_pages", value: { string_value: "128" }' in (
        repo / "decode_1" / "config.pbtxt").read_text()
    assert 'key: "num_pages", value: { string_value: "1024" }' in (
        repo / "decode" / "config.pbtxt").read_text()
    rr = (repo / "pd_ensemble_rr" / "config.pbtxt").read_text()
    assert 'string_value: "round_robin"' in rr and 'string_value: "load_aware"' not in rr
    assert 'key: "direct_decode_max_tokens", value: { string_value: "64" }' in (
        repo / "pd_ensemble_dd" / "config.pbtxt").read_text()


def test_router_names_that_clash_with_engine_models_are_refused() -> None:
    sources = {m: f'name: "{m}"\n' for m in ("prefill", "decode", "pd_ensemble")}
    with pytest.raises(ValueError):
        model_configs(FleetSpec(), (RouterVariant("decode_1", "round_robin"),), sources)
    with pytest.raises(ValueError):
        FleetSpec(decode_pages=128, small_decode_pages=1024)


def test_selections_are_read_per_router_and_differenced() -> None:
    key = 'pd_router_selections_total{{instance="{m}_0",model="{m}",role="{r}",target="{t}@127.0.0.1:1"}}'
    before = {key.format(m="pd_ensemble", r="decode", t="decode"): 4.0,
              key.format(m="pd_ensemble_rr", r="decode", t="decode_1"): 7.0}
    after = {**before, key.format(m="pd_ensemble", r="decode", t="decode"): 10.0,
             key.format(m="pd_ensemble", r="prefill", t="prefill_1"): 3.0,
             "pd_kv_free_pages{model=\"decode\"}": 5.0}
    picked = selection_delta(selections(before, "pd_ensemble"), selections(after, "pd_ensemble"))
    assert picked == {"decode": {"decode@127.0.0.1:1": 6}, "prefill": {"prefill_1@127.0.0.1:1": 3}}
    assert selections(after, "pd_ensemble_rr") == {"decode": {"decode_1@127.0.0.1:1": 7.0}}


def _record(rid: str, ttft_s: float, gaps_s: list[float]) -> RequestRecord:
    times = [ttft_s]
    for g in gaps_s:
        times.append(times[-1] + g)
    return RequestRecord(rid, "chat", 8, sent_s=0.0, token_times_s=times, num_output_tokens=len(times),
                         done_s=times[-1])


def test_goodput_counts_only_requests_within_the_slo_and_tpot_is_per_request() -> None:
    fast = _record("a", 1.0, [0.1, 0.1])           # TTFT 1 s, ITL 100 ms: meets the SLO
    late = _record("b", 5.0, [0.1, 0.1])           # TTFT 5 s > 4 s
    choppy = _record("c", 1.0, [0.1, 0.9])         # ITL p99 > 250 ms
    figures = run_figures([fast, late, choppy], SERVING_SLO)
    assert figures["num_met_slo"] == 1.0
    assert figures["goodput_requests_per_s"] == pytest.approx(1 / 5.2)   # run lasts 0 .. 5.2 s
    assert figures["tpot_p50_ms"] == pytest.approx(100.0)
    assert figures["tpot_p99_ms"] == pytest.approx(492.0)   # [100, 100, 500] ms; choppy: 1 s over 2 gaps


def test_ratio_is_none_without_a_baseline_and_order_alternates() -> None:
    assert ratio(2.0, 0.0) is None and ratio(math.nan, 1.0) is None and ratio(3.0, 2.0) == 1.5
    assert alternating("A", "B", 2) == ["A", "B", "B", "A"]
    assert alternating("A", "B", 3).count("A") == 3


def test_summary_states_the_goodput_ratio_against_the_target() -> None:
    def run(router: str, goodput: float, ttft: float) -> dict[str, object]:
        return {"router": router, "goodput_requests_per_s": goodput, "ttft_p50_ms": ttft}
    skew = [run(bench_pairing.LOAD_AWARE, 0.3, 900.0), run(bench_pairing.ROUND_ROBIN, 0.2, 3000.0),
            run(bench_pairing.ROUND_ROBIN, 0.2, 3000.0), run(bench_pairing.LOAD_AWARE, 0.36, 900.0)]
    direct = [run(bench_pairing.DIRECT, 1.0, 200.0), run(bench_pairing.LOAD_AWARE, 1.0, 400.0)]
    line = bench_pairing._summary(skew, direct)
    assert line["goodput_ratio_load_aware_over_round_robin"] == pytest.approx(1.65)
    assert line["goodput_target_met"] is True
    assert line["short_ttft_p50_ratio_direct_over_prefill"] == pytest.approx(0.5)
    zero = [run(bench_pairing.LOAD_AWARE, 0.1, 900.0), run(bench_pairing.ROUND_ROBIN, 0.0, 9000.0)]
    line = bench_pairing._summary(zero, direct)
    assert line["goodput_ratio_load_aware_over_round_robin"] is None and line["goodput_target_met"] is True


def test_short_prompts_must_be_below_the_direct_decode_bound() -> None:
    with pytest.raises(SystemExit):
        bench_pairing.parse_args(["--short-prompt-tokens", "64", "--direct-max-tokens", "64"])
