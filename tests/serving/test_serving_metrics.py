"""``serving.metrics``: names carry units, every series carries model/instance labels, unchanged gauges are
not re-sent."""

from __future__ import annotations

import pytest
from serving_fakes import FakeFamily

from serving.metrics import ServingMetrics


@pytest.fixture
def metrics() -> ServingMetrics:
    FakeFamily.registry.clear()
    return ServingMetrics(FakeFamily, model="colocated", instance="colocated_0")


def _series(name: str, **labels: str) -> float:
    key = tuple(sorted({"model": "colocated", "instance": "colocated_0", **labels}.items()))
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
    key = tuple(sorted({"model": "colocated", "instance": "colocated_0"}.items()))
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
    """A python-backend metric alive after ``finalize`` segfaults the stub on its way out: ``close()`` must drop
    the last reference to every family and series at once, and later updates must not create new ones."""
    import gc
    import weakref

    FakeFamily.registry.clear()
    metrics = ServingMetrics(FakeFamily, model="colocated", instance="colocated_0")
    metrics.set_kv_pages(10, 64)
    metrics.request_done("finished", 5, 3)
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


def test_histograms_get_vllm_buckets_and_observations() -> None:
    from serving.metrics import _HISTOGRAMS, _1_2_5_buckets

    FakeFamily.registry.clear()
    metrics = ServingMetrics(FakeFamily, model="m", instance="i")
    metrics.request_timing(0.2, 1.5, 12, 30, 0.04)
    metrics.request_timing(None, 0.1, 3, 0, None)
    series = {name: FakeFamily.registry[name].series[(("instance", "i"), ("model", "m"))] for name in _HISTOGRAMS}
    assert series["pd_time_to_first_token_seconds"].observations == [0.2]
    assert series["pd_time_per_output_token_seconds"].observations == [0.04]
    assert series["pd_e2e_request_latency_seconds"].observations == [1.5, 0.1]
    assert series["pd_request_generation_tokens"].observations == [30, 0]
    assert _1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    metrics.close()
    metrics.observe("pd_request_prompt_tokens", 5)   # ignored after close
    assert series["pd_request_prompt_tokens"].observations == [12, 3]
