"""``serving.metrics``: names carry units, every series carries model/instance/pid labels, unchanged gauges
are not re-sent."""

from __future__ import annotations

import os

import pytest
from serving_fakes import FakeFamily

from serving.metrics import ServingMetrics

# the ``pid`` label: no two stubs (an old and a new version of a model) share a series
PID = str(os.getpid())
_live: list[ServingMetrics] = []   # what ``_series`` flushes before it reads


@pytest.fixture
def metrics() -> ServingMetrics:
    FakeFamily.registry.clear()
    _live.clear()
    _live.append(ServingMetrics(FakeFamily, model="colocated", instance="colocated_0"))
    return _live[0]


def _series(name: str, **labels: str) -> float:
    for metrics in _live:
        metrics.flush()
    key = tuple(sorted({"model": "colocated", "instance": "colocated_0", "pid": PID, **labels}.items()))
    return FakeFamily.registry[name].series[key].value()


def test_names_carry_units(metrics: ServingMetrics) -> None:
    units = ("_pages", "_requests", "_total", "_instances", "_seconds", "_tokens")
    assert FakeFamily.registry.pop("pd_router_ready").kind == FakeFamily.GAUGE   # a state (0/1), no unit
    assert all(name.endswith(units) for name in FakeFamily.registry)
    assert FakeFamily.registry["pd_kv_free_pages"].kind == FakeFamily.GAUGE
    assert FakeFamily.registry["pd_requests_total"].kind == FakeFamily.COUNTER


def test_gauges_and_counters(metrics: ServingMetrics) -> None:
    metrics.set_kv_pages(10, 64)
    metrics.set_kv_pages(10, 64)
    assert _series("pd_kv_free_pages") == 10 and _series("pd_kv_total_pages") == 64
    key = tuple(sorted({"model": "colocated", "instance": "colocated_0", "pid": PID}.items()))
    assert FakeFamily.registry["pd_kv_free_pages"].series[key].writes == 1
    metrics.request_done("finished", 5, 3)
    metrics.request_done("cancelled", 2, 1)
    assert _series("pd_requests_total", outcome="finished") == 1
    assert _series("pd_prompt_tokens_total") == 7 and _series("pd_generation_tokens_total") == 4
    metrics.set_queue_length("waiting", 3)
    assert _series("pd_queue_requests", queue="waiting") == 3
    with pytest.raises(ValueError):
        metrics.request_done("lost", 0, 0)


def test_close_destroys_every_triton_metric_now() -> None:
    """A python-backend metric alive after ``finalize`` segfaults the stub on its way out: ``close()`` must
    drop the last reference to every family and series at once, and later updates must not create new ones."""
    import gc
    import weakref

    FakeFamily.registry.clear()
    metrics = ServingMetrics(FakeFamily, model="colocated", instance="colocated_0")
    metrics.set_kv_pages(10, 64)
    metrics.request_done("finished", 5, 3)
    metrics.flush()   # the series exist at Triton once the buffered updates went out
    families = [weakref.ref(f) for f in FakeFamily.registry.values()]
    series = [weakref.ref(m) for f in FakeFamily.registry.values() for m in f.series.values()]
    FakeFamily.registry.clear()   # the fake's own index; Triton keeps none in the stub's Python heap
    gc.disable()                  # freed by reference counting, in close() itself, not by a later collection
    try:
        metrics.close()
        assert series and all(ref() is None for ref in series)
        assert families and all(ref() is None for ref in families)
    finally:
        gc.enable()
    metrics.request_done("finished", 1, 1)
    metrics.set_kv_pages(1, 64)
    metrics.close()
    assert FakeFamily.registry == {}


def test_updates_are_buffered_and_the_flusher_sends_them() -> None:
    """``set_gauge``/``increment`` never talk to Triton on the caller's thread: the flusher thread sends a
    gauge's last value once and a counter's summed increments, within its interval; ``close`` sends what is
    left."""
    import time

    FakeFamily.registry.clear()
    metrics = ServingMetrics(FakeFamily, model="colocated", instance="colocated_0", flush_interval_s=0.05)
    for free in (5, 6, 7):
        metrics.set_kv_pages(free, 64)
    for _ in range(3):
        metrics.request_done("finished", 2, 1)
    key = tuple(sorted({"model": "colocated", "instance": "colocated_0", "pid": PID}.items()))
    deadline = time.monotonic() + 5
    while ("pd_kv_free_pages" not in FakeFamily.registry
           or key not in FakeFamily.registry["pd_kv_free_pages"].series):
        assert time.monotonic() < deadline, "the flusher sent nothing"
        time.sleep(0.01)
    time.sleep(0.1)
    free = FakeFamily.registry["pd_kv_free_pages"].series[key]
    assert (free.value(), free.writes) == (7, 1)
    finished = FakeFamily.registry["pd_requests_total"].series[tuple(
        sorted({**dict(key), "outcome": "finished"}.items()))]
    assert finished.value() == 3
    metrics.increment("pd_engine_steps_total", 4)
    metrics.close()
    assert FakeFamily.registry["pd_engine_steps_total"].series[key].value() == 4


def test_histograms_get_vllm_buckets_and_observations() -> None:
    from serving.metrics import _HISTOGRAMS, _1_2_5_buckets

    FakeFamily.registry.clear()
    metrics = ServingMetrics(FakeFamily, model="m", instance="i")
    metrics.request_timing(0.2, 1.5, 12, 30, 0.04)
    metrics.request_timing(None, 0.1, 3, 0, None)
    metrics.flush()
    labels = (("instance", "i"), ("model", "m"), ("pid", PID))
    series = {name: FakeFamily.registry[name].series[labels] for name in _HISTOGRAMS}
    assert series["pd_time_to_first_token_seconds"].observations == [0.2]
    assert series["pd_time_per_output_token_seconds"].observations == [0.04]
    assert series["pd_e2e_request_latency_seconds"].observations == [1.5, 0.1]
    assert series["pd_request_generation_tokens"].observations == [30, 0]
    assert _1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    metrics.close()
    metrics.observe("pd_request_prompt_tokens", 5)   # ignored after close
    assert series["pd_request_prompt_tokens"].observations == [12, 3]


def test_loop_hook_publishes_prefix_cache_deltas(metrics: ServingMetrics) -> None:
    """Counters grow by what the engine's cumulative stats grew since the last tick; the gauge follows."""
    from serving_fakes import FakeEngine

    from engine.prefix_cache import PrefixCacheStats
    from serving.metrics import LoopMetricsHook
    from serving.workers.engine_loop import EngineLoop

    snapshots = iter([PrefixCacheStats(100, 32, 4, 2), PrefixCacheStats(150, 80, 6, 6)])
    loop = EngineLoop(FakeEngine(), name="hook-test", idle_wait_s=0.02)   # never started: stats() only
    hook = LoopMetricsHook(loop, metrics, lambda: (10, 64), prefix_cache=lambda: next(snapshots))
    hook.on_tick()
    assert (_series("pd_prefix_cache_queries_tokens_total"), _series("pd_prefix_cache_hits_tokens_total"),
            _series("pd_kv_cached_pages")) == (100, 32, 4)
    hook.on_tick()
    assert (_series("pd_prefix_cache_queries_tokens_total"), _series("pd_prefix_cache_hits_tokens_total"),
            _series("pd_kv_cached_pages")) == (150, 80, 6)


def test_dp_rank_metrics_publish_each_ranks_pages_and_what_it_served(metrics: ServingMetrics) -> None:
    from engine.dp_scheduler import DPRankLoad
    from serving.metrics import DPRankMetricsHook

    loads = [DPRankLoad(requests=3, tokens=40), DPRankLoad(requests=2, tokens=25)]
    hook = DPRankMetricsHook(metrics, lambda: [7, 9], lambda: loads)
    assert hook.on_tick() is False
    loads[1].requests, loads[1].tokens = 4, 31
    hook.on_tick()
    for name, values in (("pd_dp_rank_free_pages", [7, 9]), ("pd_dp_rank_requests_total", [3, 4]),
                         ("pd_dp_rank_tokens_total", [40, 31])):
        assert [_series(name, rank=str(r)) for r in (0, 1)] == values, name
