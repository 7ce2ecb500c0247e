"""The serving prefix-cache benchmark's pure logic (scripts/perf/prefix_chat.py,
scripts/bench_prefix_cache_serving.py): workload, deployments, counters, figures, ratios. No server."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import bench_prefix_cache_serving
import pytest
from perf.prefix_chat import (
    SYSTEM_TEXT,
    USER_MESSAGES,
    CacheConfig,
    Chat,
    TurnResult,
    answers_equal,
    counters,
    delta,
    final_line,
    format_table,
    hit_rate,
    page_rounded_bound,
    schedule,
    summarize_config,
    system_prompt,
)
from perf.server import build_model_repository


class WordTokenizer:
    """One token per whitespace-separated word (each keeps its trailing space)."""

    def encode(self, text: str) -> list[int]:
        self.words = [w + " " for w in text.split()]
        return list(range(len(self.words)))

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words[i] for i in ids)


class CharTokenizer:
    """One token per character (``ord``), so decoding a prompt gives its exact text back."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class RecordingEngine:
    """Stands in for ``LLMEngine`` in ``bench_prefix_cache.ttfts``: records every prompt, answers one "!"
    token."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self._unfinished = False

    def add_request(self, request_id: str, prompt: list[int], params: object) -> None:
        self.prompts.append("".join(map(chr, prompt)))
        self._unfinished = True

    def has_unfinished(self) -> bool:
        return self._unfinished

    def step(self) -> list[SimpleNamespace]:
        self._unfinished = False
        return [SimpleNamespace(new_token_ids=[ord("!")])]


def test_the_in_process_benchmark_sends_this_workloads_text() -> None:
    """One copy of the workload text: the prompts ``bench_prefix_cache.py`` sends start with this module's
    system text and carry its user messages, turn after turn (run with a recording engine)."""
    import bench_prefix_cache

    engine = RecordingEngine()
    args = argparse.Namespace(conversations=2, turns=2, system_tokens=300, output_tokens=1)
    bench_prefix_cache.ttfts(engine, SimpleNamespace(tokenizer=CharTokenizer()),
                             args)  # type: ignore[arg-type]
    system = (SYSTEM_TEXT * 8)[:300]
    assert len(engine.prompts) == 4 and all(p.startswith(system) for p in engine.prompts)
    first, second, again = engine.prompts[0], engine.prompts[1], engine.prompts[2]   # conv 0, conv 1, conv 0
    assert first.endswith(USER_MESSAGES[0]) and second.endswith(USER_MESSAGES[1])
    assert again.startswith(first + "!") and again.endswith(USER_MESSAGES[1])


def test_system_prompt_is_cut_to_the_token_count_even_beyond_one_copy() -> None:
    tok = WordTokenizer()
    words_per_copy = len(SYSTEM_TEXT.split())
    text = system_prompt(tok, words_per_copy * 3 + 5)
    assert len(text.split()) == words_per_copy * 3 + 5
    assert text.startswith(SYSTEM_TEXT.split()[0])
    with pytest.raises(ValueError):
        system_prompt(tok, 0)


def test_each_turn_resends_the_whole_conversation_with_the_answers() -> None:
    chat = Chat("SYS.")
    p0 = chat.prompt(1, 0)
    assert p0 == "SYS. Question 1 of visitor 2: " + USER_MESSAGES[1]
    chat.answered(1, p0, " an answer.")
    p1 = chat.prompt(1, 1)
    assert p1.startswith(p0 + " an answer. Question 2 of visitor 2: ")
    assert chat.prompt(0, 0).startswith("SYS. Question 1 of visitor 1")   # other conversations untouched


def test_requests_go_turn_by_turn_across_conversations() -> None:
    assert schedule(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    with pytest.raises(ValueError):
        schedule(0, 4)


def test_the_cache_knob_is_set_on_every_engine_model(tmp_path: Path) -> None:
    pd = CacheConfig.parse("pd_off")
    repo = build_model_repository(pd.deployment_spec(colo_threads=2), tmp_path / "pd")
    for model in ("prefill", "decode"):
        config = (repo / model / "config.pbtxt").read_text()
        assert 'key: "enable_prefix_caching", value: { string_value: "false" }' in config, model
        assert 'string_value: "true"' not in config.split("enable_prefix_caching")[1][:40], model
    colo = CacheConfig.parse("colo_on").deployment_spec(colo_threads=2)
    assert colo.entry_model == "colocated" and colo.cpus == {"colocated": (0, 1)}
    config = (build_model_repository(colo, tmp_path / "colo") / "colocated" / "config.pbtxt").read_text()
    assert 'key: "enable_prefix_caching", value: { string_value: "true" }' in config
    assert 'key: "num_threads", value: { string_value: "2" }' in config
    assert pd.name == "pd_off" and pd.engine_models() == ("prefill", "decode")
    with pytest.raises(ValueError):
        CacheConfig.parse("pd")
    with pytest.raises(SystemExit):
        bench_prefix_cache_serving.parse_args(["--configs", "pd_on,colo_maybe"])


def test_quick_sizes_yield_to_explicit_ones() -> None:
    a = bench_prefix_cache_serving.parse_args(["--quick", "--turns", "3"])
    assert (a.conversations, a.turns, a.system_tokens) == (2, 3, 200)
    a = bench_prefix_cache_serving.parse_args([])
    assert (a.conversations, a.turns, a.system_tokens) == (8, 4, 500)
    assert [c.name for c in a.configs] == ["pd_on", "pd_off", "colo_on", "colo_off"]


def test_counters_are_read_per_model_and_differenced() -> None:
    key = '{name}{{instance="{m}_0",model="{m}"}}'
    metrics = {key.format(name="pd_kv_transfer_bytes_total", m="prefill"): 1000.0,
               key.format(name="pd_prefix_cache_queries_tokens_total", m="prefill"): 600.0,
               key.format(name="pd_prefix_cache_hits_tokens_total", m="prefill"): 480.0,
               key.format(name="pd_prefix_cache_queries_tokens_total", m="decode"): 0.0,
               key.format(name="pd_prefix_cache_hits_tokens_total", m="decode"): 0.0}
    before = counters(metrics, ("prefill", "decode"))
    assert before == {"kv_bytes": 1000.0, "prefill_queries": 600.0, "prefill_hits": 480.0,
                      "decode_queries": 0.0, "decode_hits": 0.0}
    after = {**before, "kv_bytes": 1500.0, "prefill_queries": 700.0}
    assert delta(before, after) == {"kv_bytes": 500.0, "prefill_queries": 100.0, "prefill_hits": 0.0,
                                    "decode_queries": 0.0, "decode_hits": 0.0}
    # series are created at their first non-zero increment: absent hits beside queries are 0 hits, and a
    # counter that appears between two scrapes counted from 0
    queries_only = {key.format(name="pd_prefix_cache_queries_tokens_total", m="prefill"): 222.0}
    fresh = counters(queries_only, ("prefill",))
    assert fresh == {"kv_bytes": None, "prefill_queries": 222.0, "prefill_hits": 0.0}
    assert delta(counters({}, ("prefill",)), fresh) == {"kv_bytes": None, "prefill_queries": 222.0,
                                                         "prefill_hits": 0.0}
    colo = counters(metrics, ("colocated",))
    assert colo == {"kv_bytes": 1000.0, "colocated_queries": None, "colocated_hits": None}
    assert delta(colo, colo)["colocated_hits"] is None
    assert hit_rate(0.0, 0.0) is None and hit_rate(None, 10.0) is None and hit_rate(9.0, 10.0) == 0.9


def _turn(conv: int, turn: int, ttft: float | None, kv: float, hits: float, queries: float,
          answer: str = "a") -> TurnResult:
    return TurnResult(conv, turn, 500 + 30 * turn, ttft,
                      {"kv_bytes": kv, "prefill_hits": hits, "prefill_queries": queries,
                       "decode_hits": hits / 2, "decode_queries": queries}, answer,
                      None if ttft is not None else "boom")


def test_summary_splits_turn_one_from_later_turns_and_pools_hit_rates() -> None:
    results = [_turn(0, 0, 1000.0, 100.0, 0.0, 500.0), _turn(1, 0, 200.0, 100.0, 480.0, 500.0),
               _turn(0, 1, 150.0, 50.0, 500.0, 540.0), _turn(1, 1, 170.0, 50.0, 500.0, 540.0),
               _turn(0, 2, None, 30.0, 520.0, 560.0)]
    s = summarize_config(results, ("prefill", "decode"))
    assert s["ttft_p50_turn1_ms"] == pytest.approx(600.0)
    assert s["ttft_p50_turns2plus_ms"] == pytest.approx(160.0)    # the failed turn has no TTFT
    assert s["num_failed"] == 1
    assert s["kv_bytes_per_request"] == pytest.approx(66.0)
    assert s["prefill_hit_rate"] == pytest.approx(2000 / 2640)
    assert s["decode_hit_rate"] == pytest.approx(1000 / 2640)
    assert (s["prompt_tokens_min"], s["prompt_tokens_max"]) == (500, 560)
    colo = summarize_config([TurnResult(0, 0, 500, 10.0, {"kv_bytes": None, "colocated_hits": None,
                                                           "colocated_queries": None}, "x")], ("colocated",))
    assert colo["kv_bytes_per_request"] is None and colo["colocated_hit_rate"] is None


def test_final_line_states_both_targets() -> None:
    summaries = {
        "pd_on": {"ttft_p50_turns2plus_ms": 250.0, "kv_bytes_per_request": 20.0, "prefill_hit_rate": 0.9,
                  "decode_hit_rate": 0.85},
        "pd_off": {"ttft_p50_turns2plus_ms": 1000.0, "kv_bytes_per_request": 100.0, "decode_hit_rate": None},
        "colo_on": {"ttft_p50_turns2plus_ms": 400.0, "colocated_hit_rate": 0.9},
        "colo_off": {"ttft_p50_turns2plus_ms": 1000.0},
    }
    results = {"pd_on": [_turn(0, 0, 1.0, 0, 0, 1, "x"), _turn(0, 1, 1.0, 0, 0, 1, "y")],
               "pd_off": [_turn(0, 0, 1.0, 0, 0, 1, "x"), _turn(0, 1, 1.0, 0, 0, 1, "z")]}
    line = final_line(summaries, results)
    assert line["pd_ttft_ratio_on_over_off"] == pytest.approx(0.25) and line["pd_ttft_target_met"] is True
    assert line["colo_ttft_ratio_on_over_off"] == pytest.approx(0.4) and line["colo_ttft_target_met"] is False
    assert line["pd_kv_ratio_on_over_off"] == pytest.approx(0.2)
    assert line["pd_kv_bound_1_minus_decode_hit"] == pytest.approx(0.15)
    assert line["pd_kv_target_met"] is False                      # 0.2 > 1 - 0.85
    assert line["pd_answers_equal_on_off"] == "1/2" and line["colo_answers_equal_on_off"] is None
    # decode without a cache (no queries): the bound is unknown, not met by default
    no_decode_cache = {**summaries, "pd_on": {**summaries["pd_on"], "decode_hit_rate": None}}
    line = final_line(no_decode_cache, results)
    assert line["pd_kv_bound_1_minus_decode_hit"] is None and line["pd_kv_target_met"] is None
    assert final_line({}, {})["pd_ttft_target_met"] is None


def test_table_has_one_row_per_configuration() -> None:
    s = summarize_config([_turn(0, 0, 900.0, 2 * 2**20, 0.0, 500.0), _turn(0, 1, 90.0, 2**20, 480.0, 530.0)],
                         ("prefill", "decode"))
    table = format_table({"pd_on": s, "colo_off": summarize_config([], ("colocated",))},
                         {"pd_on": (1.25, 2.5)})
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| pd_on | 1.2 → 2.5 | 2 (0) | 500–530 | 900 | 90 | 1.50 |")
    assert lines[3].startswith("| colo_off | — | 0 (0) |")


def test_answers_compare_by_conversation_and_turn() -> None:
    on = [_turn(1, 0, 1.0, 0, 0, 1, "p"), _turn(0, 0, 1.0, 0, 0, 1, "q")]
    off = [_turn(0, 0, 1.0, 0, 0, 1, "q"), _turn(1, 0, 1.0, 0, 0, 1, "p")]
    assert answers_equal(on, off) == "2/2" and answers_equal(on, []) is None


def test_page_rounded_bound_sends_each_prompts_partial_last_page() -> None:
    # 40-token prompt, 32 tokens (2 pages of 16) cached: 3 pages without the cache, 1 with it
    one = [TurnResult(0, 1, 40, 5.0, {"decode_hits": 32.0, "decode_queries": 40.0}, "a")]
    assert page_rounded_bound(one, 16) == pytest.approx(1 / 3)
    assert 1 - 32 / 40 < page_rounded_bound(one, 16)       # 0.2: the token-level bound cannot be reached
    full = [TurnResult(0, 1, 48, 5.0, {"decode_hits": 32.0, "decode_queries": 48.0}, "a")]
    assert page_rounded_bound(full, 16) == pytest.approx(1 - 32 / 48)   # a full last page: the bounds agree
    assert page_rounded_bound([TurnResult(0, 0, 40, 5.0, {"decode_hits": None}, "a")], 16) is None
    assert bench_prefix_cache_serving._page_size() == 16
