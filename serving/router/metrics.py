"""The router's metrics on Triton's metrics endpoint (names and labels: ``serving.metrics``)."""

from __future__ import annotations

from serving.metrics import ServingMetrics


class RouterMetricsSink:
    """``RouterMetrics`` over ``ServingMetrics``; event loop thread (``publish_*`` from the fleet thread too:
    ``pb_utils`` metrics are thread-safe, and each series is set from one thread)."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics
        self._published: set[tuple[str, str]] = set()   # (role, instance id) with a healthy-instances gauge

    def selected(self, role: str, instance_id: str, dp_rank: int | None = None) -> None:
        self._metrics.increment("pd_router_selections_total", 1, role=role, target=instance_id)
        if dp_rank is not None:
            self._metrics.increment("pd_router_dp_rank_selections_total", 1, role=role, target=instance_id,
                                    rank=str(dp_rank))

    def retried(self) -> None:
        self._metrics.increment("pd_router_retries_total", 1)

    def migrated(self) -> None:
        self._metrics.increment("pd_router_migrations_total", 1)

    def rejected(self, reason: str) -> None:
        self._metrics.increment("pd_router_rejections_total", 1, reason=reason)

    def request_done(self, outcome: str) -> None:
        self._metrics.increment("pd_router_requests_total", 1, outcome=outcome)

    def publish_queue(self, queued: int, inflight: int) -> None:
        self._metrics.set_gauge("pd_router_queue_requests", queued, state="queued")
        self._metrics.set_gauge("pd_router_queue_requests", inflight, state="inflight")

    def publish_health(self, health: dict[str, dict[str, bool]], ready: bool) -> None:
        """Every instance the fleet holds: 1 in rotation, 0 not; an instance that left the fleet (its process
        gone, the registry dropped it) reads 0 from then on instead of keeping its last value."""
        current = {(role, instance_id) for role, instances in health.items() for instance_id in instances}
        for role, instance_id in self._published - current:
            self._metrics.set_gauge("pd_router_healthy_instances", 0, role=role, target=instance_id)
        self._published |= current
        for role, instances in health.items():
            for instance_id, healthy in instances.items():
                self._metrics.set_gauge("pd_router_healthy_instances", 1 if healthy else 0, role=role,
                                        target=instance_id)
        self._metrics.set_gauge("pd_router_ready", 1 if ready else 0)
