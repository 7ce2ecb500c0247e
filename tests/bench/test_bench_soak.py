"""The pure parts of the soak benchmark (scripts/perf/soak.py): workload draws, outcomes, error kinds, KV page
accounting, the stub census and the pass/fail rule. No server."""

from __future__ import annotations

import json
import math

import pytest
from perf.soak import (
    STILL_STREAMING_S,
    Outcome,
    PromptClass,
    SoakRecord,
    SoakWorkload,
    StubDeath,
    StubWatch,
    check_loopback,
    classify_error,
    decide_outcome,
    draw_spec,
    failures,
    pages_in_use,
    stub_deaths,
    stub_instance,
    summarize,
)
from perf.stats import RequestRecord

METRICS = """\
# HELP pd_kv_free_pages Free pages in the KV pool
# TYPE pd_kv_free_pages gauge
pd_kv_free_pages{instance="prefill_0_0",model="prefill"} 500
pd_kv_free_pages{instance="decode_0_0",model="decode"} 1024
# TYPE pd_kv_total_pages gauge
pd_kv_total_pages{instance="prefill_0_0",model="prefill"} 512
pd_kv_total_pages{instance="decode_0_0",model="decode"} 1024
pd_requests_total{instance="decode_0_0",model="decode",outcome="ok"} 7
"""


def _soak_record(outcome: Outcome, token_times_s: tuple[float, ...] = (), error: str | None = None,
                 sent_s: float = 0.0) -> SoakRecord:
    spec = draw_spec(SoakWorkload(), 0)
    record = RequestRecord(spec.request_id, spec.kind, spec.num_prompt_tokens, sent_s, list(token_times_s),
                           num_output_tokens=len(token_times_s),
                           done_s=token_times_s[-1] if token_times_s else None)
    return SoakRecord(spec, record, outcome, error)


def test_draws_are_deterministic_in_seed_and_index_and_stay_in_range() -> None:
    workload = SoakWorkload(min_new_tokens=4, max_new_tokens=9, seed=3)
    specs = [draw_spec(workload, i) for i in range(400)]
    assert specs[17] == draw_spec(workload, 17)
    assert specs[17] != draw_spec(SoakWorkload(min_new_tokens=4, max_new_tokens=9, seed=4), 17)
    assert all(
        4 <= s.max_tokens <= 9 and json.loads(s.sampling_json)["max_tokens"] == s.max_tokens for s in specs)
    assert {s.kind for s in specs} == {"short", "medium", "long"}
    assert all(
        8 <= s.num_prompt_tokens <= 1500 and len(s.prompt.split()) == s.num_prompt_tokens for s in specs)


def test_about_the_cancel_fraction_is_cancelled_and_never_by_both_rules() -> None:
    specs = [draw_spec(SoakWorkload(cancel_fraction=0.2, max_cancel_delay_s=2.0), i) for i in range(2000)]
    by_count = [s for s in specs if s.cancel_after_responses is not None]
    by_delay = [s for s in specs if s.cancel_after_s is not None]
    assert 0.15 < (len(by_count) + len(by_delay)) / len(specs) < 0.25
    assert by_count and by_delay and not set(map(id, by_count)) & set(map(id, by_delay))
    assert all(1 <= s.cancel_after_responses <= s.max_tokens for s in by_count)  # type: ignore[operator]
    assert all(0 < s.cancel_after_s <= 2.0 for s in by_delay)  # type: ignore[operator]


def test_workload_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError):
        SoakWorkload(min_new_tokens=5, max_new_tokens=4)
    with pytest.raises(ValueError):
        SoakWorkload(cancel_fraction=1.5)
    with pytest.raises(ValueError):
        SoakWorkload(prompt_classes=(PromptClass("x", 10, 5, 1.0),))


def test_only_loopback_targets_are_accepted() -> None:
    assert check_loopback("127.0.0.1:8001") == "127.0.0.1"
    assert check_loopback("http://localhost:8002/metrics") == "localhost"
    assert check_loopback("http://[::1]:8002/metrics") == "::1"
    for url in ("10.0.0.5:8001", "http://example.com:8002/metrics", "0.0.0.0:8001"):
        with pytest.raises(ValueError):
            check_loopback(url)


def test_an_error_or_final_wins_over_every_wait_bound() -> None:
    assert decide_outcome(True, None, False, False, "drain") is Outcome.OK
    assert decide_outcome(False, "boom", True, True, "deadline") is Outcome.ERROR
    assert decide_outcome(False, None, True, False, "deadline") is Outcome.CANCELLED


def test_a_stream_without_final_or_error_is_no_final_unless_the_client_stopped_waiting() -> None:
    assert decide_outcome(False, None, False, True, "cancel") is Outcome.NO_FINAL  # closed by the server
    assert decide_outcome(False, None, False, False, "deadline") is Outcome.NO_FINAL   # nothing ever came
    assert decide_outcome(False, None, False, False, "deadline", STILL_STREAMING_S + 1) is Outcome.NO_FINAL
    # still delivering at the deadline: slow, not lost
    assert decide_outcome(False, None, False, False, "deadline", STILL_STREAMING_S) is Outcome.TIMED_OUT
    # closed without FINAL
    assert decide_outcome(False, None, False, True, "deadline", 0.5) is Outcome.NO_FINAL
    assert decide_outcome(False, None, False, False, "cancel") is Outcome.CANCELLED
    assert decide_outcome(False, None, False, False, "drain") is Outcome.CUT_AT_DRAIN


@pytest.mark.parametrize(("message", "kind"), [
    ("Failed to process the request(s) for model 'prefill_0_0', message: Stub process 'prefill_0_0' is not "
     "healthy.", "stub not healthy"),
    ("server busy: 256 requests in flight", "server busy"),
    ("StatusCode.RESOURCE_EXHAUSTED: too many pending", "server busy"),
    ("no healthy decode instance in the fleet", "no healthy instance"),
    ("no healthy prefill instance in the fleet (after: room 7: bootstrap timeout: no destination from decode "
     "within 30.0s)", "no healthy instance"),
    ("room=12: waiting for KV timed out after 30 s", "timeout"),
    ("StatusCode.DEADLINE_EXCEEDED: Deadline Exceeded", "timeout"),
    ("StatusCode.UNAVAILABLE: Socket closed", "unavailable"),
    ("decode: room aborted by prefill", "aborted"),
    ("invalid input 'sampling_parameters.max_tokens': must be >= 1, got 0", "bad request"),
    ("something odd", "other"),
])
def test_error_messages_group_into_kinds(message: str, kind: str) -> None:
    assert classify_error(message) == kind


def test_pages_in_use_is_total_minus_free_per_instance() -> None:
    assert pages_in_use(METRICS) == {"prefill/prefill_0_0": 12, "decode/decode_0_0": 0}
    assert pages_in_use("pd_requests_total{model=\"x\"} 3\n") == {}


def test_an_instance_without_a_free_series_counts_all_its_pages_in_use() -> None:
    assert pages_in_use('pd_kv_total_pages{instance="d_0_0",model="d"} 64\n') == {"d/d_0_0": 64}


def test_stub_instance_comes_from_the_stub_command_line_only() -> None:
    argv = ["/x/backends/python/triton_python_backend_stub", "/repo/decode/1/model.py",
            "shm_region", "1048576",
            "1048576", "6093", "/x/backends/python", "336", "decode_0_0", "DEFAULT"]
    assert stub_instance(argv) == "decode_0_0"
    assert stub_instance(["/usr/bin/python3", "-m", "bootstrap"]) is None
    assert stub_instance([]) is None


def test_a_vanished_or_replaced_stub_pid_is_a_death_and_a_new_instance_is_not() -> None:
    before = {"prefill_0_0": 10, "decode_0_0": 11, "pd_ensemble_0_0": 12}
    after = {"prefill_0_0": 10, "decode_0_0": 99, "colocated_0_0": 13}
    assert stub_deaths(before, after) == [StubDeath("decode_0_0", 11, 99),
                                          StubDeath("pd_ensemble_0_0", 12, None)]


def test_the_watch_counts_each_death_once_across_snapshots() -> None:
    watch = StubWatch()
    assert watch.observe({"a_0_0": 1, "b_0_0": 2}) == []
    assert watch.observe({"a_0_0": 1}) == [StubDeath("b_0_0", 2, None)]
    # b restarted: the death was counted when it vanished
    assert watch.observe({"a_0_0": 1, "b_0_0": 5}) == []
    assert watch.observe({"a_0_0": 7, "b_0_0": 5}) == [StubDeath("a_0_0", 1, 7)]
    assert len(watch.deaths) == 2 and watch.first == {"a_0_0": 1, "b_0_0": 2}


def test_summary_counts_outcomes_and_takes_latencies_of_ok_requests_only() -> None:
    records = [_soak_record(Outcome.OK, (0.1, 0.2, 0.4)), _soak_record(Outcome.OK, (0.3, 0.35)),
               _soak_record(Outcome.CANCELLED, (5.0, 9.0)), _soak_record(Outcome.ERROR, error="server busy"),
               _soak_record(Outcome.ERROR, error="StatusCode.UNAVAILABLE: Socket closed"),
               _soak_record(Outcome.NO_FINAL), _soak_record(Outcome.CUT_AT_DRAIN),
               _soak_record(Outcome.TIMED_OUT)]
    s = summarize(records, duration_s=10.0, pages_not_returned=0, deaths=[])
    assert (s["requests_sent"], s["completed_ok"], s["cancelled"], s["errors"]) == (8, 2, 1, 2)
    assert (s["streams_without_final"], s["cut_at_drain"], s["timed_out_streaming"]) == (1, 1, 1)
    assert failures(s) == ["1 streams without FINAL"]   # a stream slow at its deadline is not a failure
    assert s["errors_by_kind"] == {"server busy": 1, "unavailable": 1}
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p99_ms"] <= 200.0
    assert s["ok_output_tokens_per_s"] == pytest.approx(0.5)
    assert failures(s) == ["1 streams without FINAL"]


def test_summary_of_no_ok_request_has_nan_latencies() -> None:
    s = summarize([_soak_record(Outcome.CANCELLED)], duration_s=1.0, pages_not_returned=0, deaths=[])
    assert math.isnan(s["ttft_p50_ms"]) and failures(s) == []


def test_an_unhealthy_stub_error_is_a_stub_death_even_when_the_census_saw_none() -> None:
    records = [_soak_record(Outcome.ERROR, error="Stub process 'decode_0_0' is not healthy.")]
    s = summarize(records, duration_s=1.0, pages_not_returned=0, deaths=[])
    assert s["stub_deaths"] == 1 and failures(s) == ["1 stub deaths"]
    two = summarize(records, 1.0, 0, [StubDeath("a", 1, None), StubDeath("b", 2, 3)])
    assert two["stub_deaths"] == 2


def test_pages_not_returned_or_unknown_fail_the_run() -> None:
    assert failures(summarize([], 1.0, 12, [])) == ["12 KV pages not returned"]
    assert failures(summarize([], 1.0, None, []))[0].startswith("KV pages unknown")
