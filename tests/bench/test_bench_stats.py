"""Statistics of scripts/perf/stats.py: TTFT, ITL from arrival timestamps, percentiles, goodput. No server."""

from __future__ import annotations

import math

import pytest
from perf.stats import RequestRecord, Slo, inter_token_latencies_ms, percentile, run_duration_s, summarize


def _record(rid: str, sent_s: float, token_times_s: list[float], done_s: float | None = None,
            error: str | None = None) -> RequestRecord:
    return RequestRecord(request_id=rid, kind="chat", num_prompt_tokens=8, sent_s=sent_s,
                         token_times_s=token_times_s, num_output_tokens=len(token_times_s),
                         done_s=token_times_s[-1] if done_s is None and token_times_s else done_s,
                         error=error)


def test_itl_is_the_gap_between_consecutive_arrivals_in_ms() -> None:
    assert inter_token_latencies_ms([1.0, 1.1, 1.35]) == pytest.approx([100.0, 250.0])
    assert inter_token_latencies_ms([2.0]) == []


def test_itl_rejects_out_of_order_timestamps() -> None:
    with pytest.raises(ValueError):
        inter_token_latencies_ms([1.0, 0.5])


def test_percentile_interpolates_linearly_and_is_nan_when_empty() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ttft_is_first_token_minus_send_time() -> None:
    assert _record("a", 10.0, [10.25, 10.3]).ttft_ms == pytest.approx(250.0)


def test_summary_pools_itls_of_all_requests_and_counts_tokens_over_the_run() -> None:
    records = [_record("a", 0.0, [0.1, 0.2, 0.3]), _record("b", 0.0, [0.2, 0.6])]
    summary = summarize(records, duration_s=run_duration_s(records), slo=Slo(ttft_ms=1000, itl_p99_ms=1000))
    assert summary["duration_s"] == pytest.approx(0.6)
    assert summary["ttft_p50_ms"] == pytest.approx(150.0)
    assert summary["itl_p50_ms"] == pytest.approx(100.0)  # gaps 100, 100, 400
    assert summary["itl_p99_ms"] == pytest.approx(394.0)
    assert summary["output_tokens_per_s"] == pytest.approx(5 / 0.6)
    assert summary["goodput_requests_per_s"] == pytest.approx(2 / 0.6)


def test_goodput_counts_only_requests_within_both_bounds() -> None:
    slo = Slo(ttft_ms=200, itl_p99_ms=150)
    fast = _record("fast", 0.0, [0.1, 0.2, 0.3])
    slow_start = _record("slow_start", 0.0, [0.5, 0.6])
    stuttering = _record("stutter", 0.0, [0.1, 0.2, 0.5])
    failed = _record("failed", 0.0, [0.1], error="boom")
    assert [slo.met_by(r) for r in (fast, slow_start, stuttering, failed)] == [True, False, False, False]
    summary = summarize([fast, slow_start, stuttering, failed], duration_s=1.0, slo=slo)
    assert summary["goodput_requests_per_s"] == pytest.approx(1.0)
    assert summary["requests_per_s"] == pytest.approx(3.0)
    assert summary["num_failed"] == 1.0


def test_unfinished_or_tokenless_requests_are_not_ok() -> None:
    assert not _record("none", 0.0, [], done_s=1.0).ok
    assert not RequestRecord("open", "chat", 8, 0.0, token_times_s=[0.1]).ok


def test_slo_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Slo(ttft_ms=0, itl_p99_ms=10)
