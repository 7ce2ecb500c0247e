"""The statistics glue of scripts/bench_triton_overhead.py: specs, response stamping, figures, overhead. No
server, no engine."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from bench_triton_overhead import (
    BenchConfig,
    PathFigures,
    _record_response,
    _StampingSink,
    figures,
    make_specs,
    overhead,
)
from perf.stats import RequestRecord


def _record(sent_s: float, token_times_s: list[float], error: str | None = None) -> RequestRecord:
    return RequestRecord("r", "chat", 0, sent_s, token_times_s=token_times_s, num_output_tokens=len(token_times_s),
                         done_s=token_times_s[-1] if token_times_s else sent_s, error=error)


def _grpc_result(text: bytes | None, final: bool, num_output_tokens: int | None = None) -> Any:
    """A stand-in for tritonclient's InferResult: ``as_numpy`` and ``get_response().parameters``."""
    arrays = {} if text is None else {"text_output": np.array([text], dtype=np.object_)}
    if num_output_tokens is not None:
        arrays["num_output_tokens"] = np.array([num_output_tokens], dtype=np.int32)
    params = {"triton_final_response": SimpleNamespace(bool_param=final)}
    return SimpleNamespace(as_numpy=arrays.get, get_response=lambda: SimpleNamespace(parameters=params))


def test_both_paths_get_the_same_prompts_for_the_same_seeds() -> None:
    cfg = BenchConfig(num_requests=3, prompt_tokens=16, max_tokens=4, concurrencies=(1,))
    a, b = make_specs(cfg, "direct", 3, 100), make_specs(cfg, "triton", 3, 100)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert len({s.prompt for s in a}) == 3
    assert '"temperature": 0.0' in a[0].sampling_json and '"ignore_eos": true' in a[0].sampling_json


def test_grpc_stamps_only_non_empty_texts_and_ends_at_the_final_flag() -> None:
    record = RequestRecord("r", "chat", 0, 1.0)
    # num_output_tokens: the tokens of each response (the vLLM convention)
    _record_response(record, 1.5, _grpc_result(b"Hello", False, 1), None)
    _record_response(record, 1.6, _grpc_result(b"", False, 0), None)  # an empty delta is not a token
    _record_response(record, 1.7, _grpc_result(b" world", False, 1), None)
    assert record.done_s is None
    _record_response(record, 1.8, _grpc_result(None, True), None)  # the empty final response
    assert record.token_times_s == [1.5, 1.7] and record.done_s == 1.8 and record.num_output_tokens == 2
    assert record.ttft_ms == pytest.approx(500.0) and record.itls_ms == pytest.approx([200.0])


def test_grpc_error_ends_the_record_with_its_message() -> None:
    record = RequestRecord("r", "chat", 0, 1.0)
    _record_response(record, 2.0, None, RuntimeError("boom"))
    assert record.error == "boom" and record.done_s == 2.0 and not record.ok


def test_direct_sink_stamps_non_empty_texts_and_ends_at_final() -> None:
    record = RequestRecord("r", "chat", 0, 0.0)
    sink = _StampingSink(record)
    sink.send(SimpleNamespace(text="a", num_output_tokens=1), final=False)
    sink.send(SimpleNamespace(text="", num_output_tokens=1), final=True)
    assert len(record.token_times_s) == 1 and record.done_s is not None and sink.done.is_set()


def test_figures_pool_itl_gaps_and_leave_failed_requests_out() -> None:
    records = [_record(0.0, [0.1, 0.2, 0.4]), _record(1.0, [1.3, 1.4]), _record(2.0, [2.5], error="x")]
    f = figures(records)
    assert (f.num_requests, f.num_failed) == (3, 1)
    assert f.ttft_p50_ms == pytest.approx(200.0)  # TTFTs 100 and 300 ms
    assert f.itl_p50_ms == pytest.approx(100.0) and f.itl_mean_ms == pytest.approx(400.0 / 3)


def test_overhead_is_triton_minus_direct_and_itl_in_percent() -> None:
    direct = PathFigures(4, 0, ttft_p50_ms=100.0, ttft_p99_ms=150.0, itl_p50_ms=50.0, itl_p99_ms=80.0,
                         itl_mean_ms=55.0)
    triton = PathFigures(4, 0, ttft_p50_ms=108.0, ttft_p99_ms=170.0, itl_p50_ms=55.0, itl_p99_ms=80.0,
                         itl_mean_ms=55.0)
    o = overhead(direct, triton)
    assert o["added_ttft_p50_ms"] == pytest.approx(8.0) and o["added_ttft_p99_ms"] == pytest.approx(20.0)
    assert o["added_itl_pct"] == pytest.approx(10.0) and o["added_itl_p99_pct"] == pytest.approx(0.0)
    no_itl = PathFigures(1, 0, 1.0, 1.0, float("nan"), float("nan"), float("nan"))
    assert math.isnan(overhead(no_itl, triton)["added_itl_pct"])
