"""Custom metrics of the serving workers, shown on Triton's metrics endpoint (``:8002/metrics``).

``ServingMetrics`` wraps python-backend metric families (``pb_utils.MetricFamily``, passed in so this module
stays importable without Triton). Every metric carries the labels ``model``, ``instance`` and ``pid`` (the
stub process: see ``ServingMetrics``); names carry units:

==================================  =======  =================================================================
``pd_kv_free_pages``                gauge    free pages in the KV pool
``pd_kv_total_pages``               gauge    pages in the KV pool
``pd_kv_cached_pages``              gauge    pages holding reusable prefix-cache KV (held or evictable)
``pd_prefix_cache_queries_tokens_total`` counter  prompt tokens of requests admitted with the prefix cache on
``pd_prefix_cache_hits_tokens_total`` counter  of those, tokens whose KV came from the prefix cache (hit rate:
                                             hits / queries)
``pd_queue_requests``               gauge    requests per queue (label ``queue``: ``running``, ``commands``;
                                             PD workers add ``bootstrap``, ``waiting``, ``inflight``,
                                             ``prealloc``, ``transfer``)
``pd_requests_total``               counter  finished requests (label ``outcome``: ``finished``, ``failed``,
                                             ``cancelled``)
``pd_prompt_tokens_total``          counter  prompt tokens of finished requests
``pd_generation_tokens_total``      counter  generated tokens of finished requests
``pd_engine_steps_total``           counter  engine steps
``pd_dp_rank_free_pages``           gauge    DP attention: free pages of each rank's pool (label ``rank``)
``pd_dp_rank_requests_total``       counter  DP attention: requests assigned to each rank (label ``rank``)
``pd_dp_rank_tokens_total``         counter  DP attention: tokens each rank computed (label ``rank``)
``pd_engine_step_seconds_total``    counter  time spent in engine steps
``pd_kv_transfer_bytes_total``      counter  KV bytes posted to decode instances (prefill): whole pages, and
                                             only the filled slots of a prompt's last page (aux data not
                                             counted)
``pd_kv_transfers_total``           counter  rooms whose KV transfer reached Success
``pd_kv_failed_rooms_total``        counter  rooms whose KV transfer failed (timeouts included)
``pd_kv_timed_out_rooms_total``     counter  rooms failed by the bootstrap or waiting timeout
``pd_kv_fenced_rooms_total``        counter  decode: failed rooms whose writer was fenced before their pages
                                             went back (a write failed or the writer vanished; a no-op on
                                             NIXL)
``pd_kv_skipped_pages_total``       counter  prompt pages not sent (prefill) / not received (decode): decode
                                             held them already (its prefix cache)
``pd_kv_transfer_seconds_total``    counter  prefill: first KV chunk posted → last WRITE done, summed
``pd_kv_transfer_tail_seconds_total`` counter  prefill: last KV chunk posted → last WRITE done, summed
``pd_router_queue_requests``        gauge    router: requests waiting for admission (label ``state``:
                                             ``queued``, ``inflight``)
``pd_router_selections_total``      counter  router: requests sent per instance (labels ``role``, ``target``)
``pd_router_dp_rank_selections_total`` counter  router: requests sent per DP-attention rank of an instance
                                             (labels ``role``, ``target``, ``rank``)
``pd_router_retries_total``         counter  router: attempts retried on another pair before the first token
``pd_router_migrations_total``      counter  router: requests moved to another decode instance after the first
                                             token
``pd_router_rejections_total``      counter  router: requests refused (label ``reason``: ``busy``,
                                             ``no_prefill``, ``no_decode``)
``pd_router_requests_total``        counter  router: requests ended (label ``outcome``)
``pd_router_healthy_instances``     gauge    router: 1 while an instance is in rotation (``role``, ``target``)
``pd_router_ready``                 gauge    router: 1 while at least one prefill and one decode are in
                                             rotation
``pd_time_to_first_token_seconds``  histo    public models (pd_ensemble, colocated): request arrival → first
                                             text queued for the client, per finished request
``pd_time_per_output_token_seconds`` histo   public models: (end − first token) / (output tokens − 1), per
                                             finished request with at least two tokens (TPOT; per sample)
``pd_e2e_request_latency_seconds``  histo    public models: request arrival → final response queued
``pd_request_prompt_tokens``        histo    public models: prompt tokens per finished request
``pd_request_generation_tokens``    histo    public models: generated tokens per finished request (all
                                             samples)
==================================  =======  =================================================================

Histogram buckets are those of vLLM's own metrics (``vllm:time_to_first_token_seconds`` and its siblings, as
the vLLM backend exports them), so dashboards built for either read the same boundaries.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from engine.prefix_cache import PrefixCacheStats

logger = logging.getLogger(__name__)

OUTCOMES: tuple[str, ...] = ("finished", "failed", "cancelled")


class Metric(Protocol):
    """One labelled series (``pb_utils.Metric``)."""

    def set(self, value: float) -> None: ...

    def increment(self, value: float) -> None: ...

    def value(self) -> float: ...

    def observe(self, value: float) -> None: ...


class MetricFamilyFactory(Protocol):
    """``pb_utils.MetricFamily``: ``MetricFamily(name, description, kind)``, ``.Metric(labels=...)``
    (histograms: ``.Metric(labels=..., buckets=[...])``, then ``observe(value)``)."""

    COUNTER: Any
    GAUGE: Any
    HISTOGRAM: Any

    def __call__(self, name: str, description: str, kind: Any) -> Any: ...


_FAMILIES: dict[str, tuple[str, str]] = {  # name → (kind, description)
    "pd_kv_free_pages": ("GAUGE", "Free pages in the KV pool"),
    "pd_kv_total_pages": ("GAUGE", "Pages in the KV pool"),
    "pd_kv_cached_pages": ("GAUGE", "Pages holding reusable prefix-cache KV (held or evictable)"),
    "pd_prefix_cache_queries_tokens_total": ("COUNTER", "Prompt tokens of requests admitted, cache on"),
    "pd_prefix_cache_hits_tokens_total": ("COUNTER", "Prompt tokens whose KV came from the prefix cache"),
    "pd_queue_requests": ("GAUGE", "Requests per queue"),
    "pd_requests_total": ("COUNTER", "Finished requests by outcome"),
    "pd_prompt_tokens_total": ("COUNTER", "Prompt tokens of finished requests"),
    "pd_generation_tokens_total": ("COUNTER", "Generated tokens of finished requests"),
    "pd_engine_steps_total": ("COUNTER", "Engine steps"),
    "pd_dp_rank_free_pages": ("GAUGE", "DP attention: free pages of each rank's KV pool"),
    "pd_dp_rank_requests_total": ("COUNTER", "DP attention: requests assigned to each rank"),
    "pd_dp_rank_tokens_total": ("COUNTER", "DP attention: tokens each rank computed"),
    "pd_engine_step_seconds_total": ("COUNTER", "Seconds spent in engine steps"),
    "pd_kv_transfer_bytes_total": ("COUNTER", "KV bytes posted to decode instances (prefill)"),
    "pd_kv_transfers_total": ("COUNTER", "Rooms whose KV transfer reached Success"),
    "pd_kv_failed_rooms_total": ("COUNTER", "Rooms whose KV transfer failed (timeouts included)"),
    "pd_kv_timed_out_rooms_total": ("COUNTER", "Rooms failed by the bootstrap or waiting timeout"),
    "pd_kv_fenced_rooms_total": ("COUNTER", ("Decode: failed rooms whose writer was fenced before their "
                                             "pages went back (a write failed or the writer vanished)")),
    "pd_kv_skipped_pages_total": ("COUNTER", ("Prompt pages not sent (prefill) or not received (decode) "
                                              "because decode held them already (prefix cache)")),
    "pd_kv_transfer_seconds_total": ("COUNTER", "Prefill: seconds from a room's first KV chunk posted to its "
                                     "last WRITE done, summed over rooms"),
    "pd_kv_transfer_tail_seconds_total": ("COUNTER", "Prefill: seconds from a room's last KV chunk posted to "
                                          "its last WRITE done, summed over rooms"),
    "pd_router_queue_requests": ("GAUGE", "Router: requests waiting for admission (queued) and orchestrated "
                                 "(inflight)"),
    "pd_router_selections_total": ("COUNTER", "Router: requests sent per instance"),
    "pd_router_dp_rank_selections_total": ("COUNTER", "Router: requests sent per DP-attention rank of an "
                                                      "instance"),
    "pd_router_retries_total": ("COUNTER", "Router: attempts retried on another pair before the first token"),
    "pd_router_migrations_total": ("COUNTER", "Router: requests moved to another decode instance after the "
                                              "first token"),
    "pd_router_rejections_total": ("COUNTER", "Router: requests refused (busy, no healthy instance)"),
    "pd_router_requests_total": ("COUNTER", "Router: requests ended, by outcome"),
    "pd_router_healthy_instances": ("GAUGE", "Router: 1 while the instance is in rotation"),
    "pd_router_ready": ("GAUGE", "Router: 1 while at least one prefill and one decode instance are in "
                                 "rotation"),
}


def _1_2_5_buckets(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``maximum`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return buckets
            buckets.append(float(value))
        exponent += 1


_HISTOGRAMS: dict[str, tuple[str, list[float]]] = {  # name → (description, buckets)
    "pd_time_to_first_token_seconds": (
        "Seconds from a request's arrival to its first text",
        [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]),
    "pd_time_per_output_token_seconds": (
        "Seconds per output token after the first (TPOT)",
        [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]),
    "pd_e2e_request_latency_seconds": (
        "Seconds from a request's arrival to its final response",
        [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]),
    "pd_request_prompt_tokens": ("Prompt tokens per finished request", _1_2_5_buckets(32768)),
    "pd_request_generation_tokens": ("Generated tokens per finished request", _1_2_5_buckets(32768)),
}


#: How often the flusher thread hands buffered updates to tritonserver, seconds (what a scrape may lag by).
FLUSH_INTERVAL_S = 0.05

_Key = tuple[str, tuple[tuple[str, str], ...]]   # (metric name, sorted extra labels)


class ServingMetrics:
    """The metrics of one model instance. Create once per process (Triton families are process-wide).

    Updates are buffered: ``set_gauge``, ``increment`` and ``observe`` only note the change (any thread, a few
    microseconds), and a flusher thread (``metrics-<instance>``) hands them to tritonserver every
    ``flush_interval_s``: a gauge's last value (unchanged values are not sent), a counter's summed increments,
    every histogram observation. Why: each python-backend ``Metric.set``/``increment``/``observe`` is a round
    trip to the server process that holds the GIL while it waits (py-spy, tritonserver 2.51: a quarter of a
    prefill engine loop's GIL time went to gauges set every tick), which delayed first tokens and decode
    steps.

    Each series also carries ``pid``, the stub's process id, so that no two stubs ever share one: tritonserver
    (core ``src/metric_family.cc``, 2.51 and still upstream) gives every ``MetricFamily`` object its own
    reference count of the prometheus series it added, while two families of one name (an old and a new
    version of a model during a reload: both alive until the old one's last request ends) share prometheus'
    family and so the series of equal labels. The first stub to delete its ``Metric`` frees the series under
    the other, whose next update writes freed memory: a reload of ``decode`` under traffic aborted
    tritonserver (``malloc(): unaligned fastbin chunk detected``), and the new version's series were gone from
    ``/metrics`` (``test_healing_live``).

    ``close()`` must run in the model's ``finalize``: a python-backend ``Metric`` or ``MetricFamily`` sends a
    delete message to tritonserver when it is destroyed, and one still alive when the stub tears itself down
    (after ``finalize`` returned) dereferences the stub's freed shared-memory pool (tritonserver 2.51:
    segfault in ``Metric::SaveToSharedMemory``). It flushes what is buffered first; updates after ``close()``
    are ignored.
    """

    def __init__(self, family_factory: MetricFamilyFactory, model: str, instance: str,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        """
        Args:
            family_factory: ``pb_utils.MetricFamily`` (or anything with the same interface).
            model: value of the ``model`` label (the Triton model name).
            instance: value of the ``instance`` label (the Triton model instance name); the ``pid`` label is
                this process's id.
            flush_interval_s: period of the flusher thread (started here), seconds.
        """
        self._labels = {"model": model, "instance": instance, "pid": str(os.getpid())}
        self._families = {name: family_factory(name=name, description=desc,
                                               kind=getattr(family_factory, kind))
                          for name, (kind, desc) in _FAMILIES.items()}
        self._families.update({name: family_factory(name=name, description=desc,
                                                    kind=family_factory.HISTOGRAM)
                               for name, (desc, _) in _HISTOGRAMS.items()})
        self._series: dict[_Key, Metric] = {}
        self._last_gauge: dict[_Key, float] = {}
        # held while talking to Triton (flush) and by close(): a flush never sends through a metric that
        # close() is destroying, and nothing keeps a metric alive past close()
        self._lock = threading.Lock()
        self._closed = False
        # held only to note or take buffered updates: the engine and router threads never wait for a round
        # trip
        self._pending_lock = threading.Lock()
        self._accepting = True
        self._gauges: dict[_Key, float] = {}
        self._counts: dict[_Key, float] = {}
        self._observations: list[tuple[_Key, float]] = []
        self._interval_s = flush_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{instance}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Flush, then destroy every Triton metric and family now (model ``finalize``; see the class
        docstring). Idempotent."""
        self._stop.set()
        with self._pending_lock:
            self._accepting = False
        with self._lock:
            if not self._closed:
                try:
                    self._flush_locked()
                except Exception:   # the server may be going away; the metrics are destroyed regardless
                    logger.exception("metrics: last flush failed")
            self._closed = True
            self._series.clear()     # each Metric is deleted at tritonserver here, while the stub still runs
            self._families.clear()
            self._last_gauge.clear()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def flush(self) -> None:
        """Hand every buffered update to tritonserver now (the flusher thread does it every interval)."""
        with self._lock:
            if not self._closed:
                self._flush_locked()

    def _flush_locked(self) -> None:
        with self._pending_lock:
            gauges, counts, observations = self._gauges, self._counts, self._observations
            self._gauges, self._counts, self._observations = {}, {}, []
        for key, value in gauges.items():
            if self._last_gauge.get(key) != value:
                self._metric(key).set(value)
                self._last_gauge[key] = value
        for key, value in counts.items():
            self._metric(key).increment(value)
        for key, value in observations:
            self._metric(key).observe(value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.flush()
            except Exception:   # one bad round trip must not end the metrics of this instance
                logger.exception("metrics: flush failed")

    def _metric(self, key: _Key) -> Metric:
        metric = self._series.get(key)
        if metric is None:
            name = key[0]
            labels = {**self._labels, **dict(key[1])}
            family = self._families[name]
            metric = (family.Metric(labels=labels, buckets=_HISTOGRAMS[name][1]) if name in _HISTOGRAMS
                      else family.Metric(labels=labels))
            self._series[key] = metric
        return metric

    def observe(self, name: str, value: float) -> None:
        """Add one observation to a histogram (one of ``_HISTOGRAMS``' names)."""
        with self._pending_lock:
            if self._accepting:
                self._observations.append(((name, ()), float(value)))

    def request_timing(self, ttft_s: float | None, e2e_s: float, num_prompt_tokens: int,
                       num_output_tokens: int, tpot_s: float | None) -> None:
        """The latency and length histograms of one finished client request (seconds, tokens)."""
        if ttft_s is not None:
            self.observe("pd_time_to_first_token_seconds", ttft_s)
        if tpot_s is not None:
            self.observe("pd_time_per_output_token_seconds", tpot_s)
        self.observe("pd_e2e_request_latency_seconds", e2e_s)
        self.observe("pd_request_prompt_tokens", num_prompt_tokens)
        self.observe("pd_request_generation_tokens", num_output_tokens)

    def set_gauge(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge (one of this module's names); a value equal to the last one sent is not sent again."""
        if name not in _FAMILIES:
            raise KeyError(f"unknown metric {name!r}")
        with self._pending_lock:
            if self._accepting:
                self._gauges[(name, tuple(sorted(labels.items())))] = float(value)

    def increment(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` (>= 0) to a counter (one of this module's names)."""
        if value <= 0:
            return
        if name not in _FAMILIES:
            raise KeyError(f"unknown metric {name!r}")
        key = (name, tuple(sorted(labels.items())))
        with self._pending_lock:
            if self._accepting:
                self._counts[key] = self._counts.get(key, 0.0) + float(value)

    def set_queue_length(self, queue: str, num_requests: int) -> None:
        """``pd_queue_requests{queue=...}``: requests currently held in ``queue``."""
        self.set_gauge("pd_queue_requests", num_requests, queue=queue)

    def set_kv_pages(self, free_pages: int, total_pages: int) -> None:
        """``pd_kv_free_pages`` / ``pd_kv_total_pages``."""
        self.set_gauge("pd_kv_free_pages", free_pages)
        self.set_gauge("pd_kv_total_pages", total_pages)

    def request_done(self, outcome: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Count one request that ended; ``outcome`` is one of ``OUTCOMES``. Raises ValueError otherwise."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        self.increment("pd_requests_total", 1, outcome=outcome)
        self.increment("pd_prompt_tokens_total", num_prompt_tokens)
        self.increment("pd_generation_tokens_total", num_output_tokens)


class LoopCounters(Protocol):
    """What ``LoopMetricsHook`` reads of a loop's ``stats()`` (``serving.workers.engine_loop.LoopStats``)."""

    @property
    def num_active_requests(self) -> int: ...

    @property
    def num_queued_commands(self) -> int: ...

    @property
    def steps_total(self) -> int: ...

    @property
    def step_seconds_total(self) -> float: ...


class CountedLoop(Protocol):
    """The loop whose counters ``LoopMetricsHook`` publishes (``serving.workers.engine_loop.EngineLoop``)."""

    def stats(self) -> LoopCounters:
        """The loop's counters now; called on the loop thread."""
        ...


class LoopMetricsHook:
    """Tick hook that publishes the KV pool and the loop's counters (runs on the loop thread)."""

    def __init__(self, loop: CountedLoop, metrics: ServingMetrics,
                 kv_pages: Callable[[], tuple[int, int]],
                 prefix_cache: Callable[[], PrefixCacheStats] | None = None) -> None:
        """
        Args:
            loop: the loop whose ``stats()`` to publish.
            metrics: where to publish.
            kv_pages: returns ``(free_pages, total_pages)`` of the engine, called on the loop thread.
            prefix_cache: returns the engine's ``PrefixCacheStats`` (``LLMEngine.prefix_cache_stats``), called
                on the loop thread; None publishes no prefix-cache metrics.
        """
        self._loop = loop
        self._metrics = metrics
        self._kv_pages = kv_pages
        self._prefix_cache = prefix_cache
        self._steps_seen = 0
        self._step_seconds_seen = 0.0
        self._cache_seen = PrefixCacheStats()

    def on_tick(self) -> bool:
        """Publish; never reports work in flight."""
        stats = self._loop.stats()
        self._metrics.set_kv_pages(*self._kv_pages())
        self._metrics.set_queue_length("running", stats.num_active_requests)
        self._metrics.set_queue_length("commands", stats.num_queued_commands)
        self._metrics.increment("pd_engine_steps_total", stats.steps_total - self._steps_seen)
        self._metrics.increment("pd_engine_step_seconds_total",
                                stats.step_seconds_total - self._step_seconds_seen)
        self._steps_seen, self._step_seconds_seen = stats.steps_total, stats.step_seconds_total
        if self._prefix_cache is not None:
            self._publish_prefix_cache(self._prefix_cache())
        return False

    def _publish_prefix_cache(self, cache: PrefixCacheStats) -> None:
        seen = self._cache_seen
        self._metrics.set_gauge("pd_kv_cached_pages", cache.cached_pages)
        self._metrics.increment("pd_prefix_cache_queries_tokens_total",
                                cache.queries_tokens - seen.queries_tokens)
        self._metrics.increment("pd_prefix_cache_hits_tokens_total", cache.hits_tokens - seen.hits_tokens)
        self._cache_seen = cache


class DPRankMetricsHook:
    """Tick hook publishing a DP-attention engine's per-rank load (``pd_dp_rank_*``, label ``rank``): free
    pages of each rank's pool, requests assigned and tokens computed (runs on the loop thread).

    Args:
        metrics: where to publish.
        free_pages: returns each rank's free pages (``LLMEngine.rank_free_pages``).
        loads: returns each rank's counters (``LLMEngine.dp_loads``: ``requests``, ``tokens``).
    """

    def __init__(self, metrics: ServingMetrics, free_pages: Callable[[], list[int]],
                 loads: Callable[[], list[Any]]) -> None:
        self._metrics = metrics
        self._free_pages = free_pages
        self._loads = loads
        self._seen: dict[int, tuple[int, int]] = {}

    def on_tick(self) -> bool:
        """Publish; never reports work in flight."""
        for rank, free in enumerate(self._free_pages()):
            self._metrics.set_gauge("pd_dp_rank_free_pages", free, rank=str(rank))
        for rank, load in enumerate(self._loads()):
            requests, tokens = self._seen.get(rank, (0, 0))
            self._metrics.increment("pd_dp_rank_requests_total", load.requests - requests, rank=str(rank))
            self._metrics.increment("pd_dp_rank_tokens_total", load.tokens - tokens, rank=str(rank))
            self._seen[rank] = (load.requests, load.tokens)
        return False
