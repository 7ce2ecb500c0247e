"""Builds the PD workers: engine + engine loop + KV manager (with the instance's own rendezvous), wired for
one model instance, and announced to the fleet's membership registry when one is configured.

Start order (``PDWorkerHandle.start``): KV manager (registers the KV region with its transport, starts the
instance's rendezvous), engine loop, then the membership announcement (routers may pair it from then on). Stop
order, the reverse: withdraw from the membership, engine loop (requests in flight end with an error and
FINAL), KV manager (fails open rooms, tells the peers, stops the rendezvous).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bootstrap.membership import Member, Membership, make_membership
from engine.errors import EngineError
from kv_transfer import BaseKVManager, KVArgs, KVLayout, make_kv_manager
from kv_transfer.head_slices import KVRegion
from serving.config import ConfigError, WorkerConfig
from serving.metrics import DPRankMetricsHook, LoopMetricsHook, ServingMetrics
from serving.workers.decode import DecodeWorker
from serving.workers.engine_loop import EngineLoop
from serving.workers.prefill import PrefillWorker

if TYPE_CHECKING:
    from engine import LLMEngine

logger = logging.getLogger(__name__)


#: Load report period of a PD worker to its own rendezvous, seconds: routers read the load there.
HEARTBEAT_INTERVAL_S = 0.5
#: How long the registry keeps a worker that stopped renewing (a killed process), seconds. Routers notice a
#: dead worker sooner: its rendezvous refuses their next poll.
MEMBER_TTL_S = 10.0


def kv_args(config: WorkerConfig, engine: LLMEngine, instance_id: str, role: str, model_name: str = "",
            worker_endpoint: str = "") -> KVArgs:
    """The KV manager's arguments for ``engine``'s pool (``[num_layers, 2, num_pages, page_size, kv_heads,
    head_dim]``, one contiguous region; a tensor-parallel engine: one per rank, as ``kv_regions``; a
    DP-attention engine: every rank's pool as one region, page ids ``rank * num_pages + p``), registered
    as ``model_name`` served at ``config.grpc_url`` and at ``worker_endpoint`` (empty: none)."""
    pools = engine.kv_pools
    pool = pools[0][1]   # rank 0's (tensor-parallel: the first region), or a DP engine's whole region
    # split over ranks: the layout names the model's KV heads (each region its own); else the pool's (MLA: 1)
    num_kv_heads = engine.kv_heads.num_model_kv_heads if len(pools) > 1 else pool.shape.num_kv_heads
    layout = KVLayout(num_layers=pool.shape.num_layers, num_pages=pool.num_pages, page_size=config.page_size,
                      num_kv_heads=num_kv_heads, head_dim=pool.shape.head_dim,
                      dtype=config.dtype, kind=pool.shape.kind, weight_quant=config.weight_quant)
    regions = tuple(KVRegion(heads.start, heads.stop, p.base_ptr) for heads, p in pools) if len(pools) > 1 \
        else ()
    on_gpu = config.device.startswith("cuda")
    return KVArgs(instance_id=instance_id, role=role, kv_base_ptr=pool.base_ptr,
                  kv_nbytes=sum(p.nbytes for _, p in pools), kv_regions=regions,
                  layout=layout, model_id=engine.model_config.model_id,
                  rendezvous_port=config.rendezvous_port, fleet_secret=config.fleet_secret,
                  fleet_tls=config.fleet_tls,
                  bootstrap_timeout_s=config.bootstrap_timeout_s, waiting_timeout_s=config.waiting_timeout_s,
                  peer_lost_s=config.blip_tolerance_s,
                  mem_type="VRAM" if on_gpu else "DRAM", address=config.grpc_url, model_name=model_name,
                  worker_endpoint=worker_endpoint,
                  heartbeat_interval_s=HEARTBEAT_INTERVAL_S, local_hostname=config.grpc_url.rsplit(":", 1)[0],
                  device_id=int(config.device.split(":")[1]) if on_gpu and ":" in config.device else 0)


class KVMetricsHook:
    """Tick hook publishing the KV manager's counters (``pd_kv_*``) and the transfer time of finished
    rooms."""

    def __init__(self, kv_manager: BaseKVManager, metrics: ServingMetrics,
                 worker: PrefillWorker | DecodeWorker | None = None) -> None:
        self._kv = kv_manager
        self._metrics = metrics
        self._worker = worker
        self._seen: dict[str, float] = {}

    def on_tick(self) -> bool:
        values: dict[str, float] = {k: float(v) for k, v in self._kv.metrics().items()}
        if isinstance(self._worker, PrefillWorker):
            values["transfer_seconds_total"] = self._worker.transfer_seconds_total
            values["transfer_tail_seconds_total"] = self._worker.transfer_tail_seconds_total
        for key, name in (("kv_bytes_total", "pd_kv_transfer_bytes_total"),
                          ("transfers_total", "pd_kv_transfers_total"),
                          ("failed_rooms_total", "pd_kv_failed_rooms_total"),
                          ("timed_out_rooms_total", "pd_kv_timed_out_rooms_total"),
                          ("fenced_rooms_total", "pd_kv_fenced_rooms_total"),
                          ("skipped_pages_total", "pd_kv_skipped_pages_total"),
                          ("transfer_seconds_total", "pd_kv_transfer_seconds_total"),
                          ("transfer_tail_seconds_total", "pd_kv_transfer_tail_seconds_total")):
            if key in values:
                self._metrics.increment(name, values[key] - self._seen.get(key, 0.0))
                self._seen[key] = values[key]
        return False


@dataclass
class PDWorkerHandle:
    """A started-or-not PD worker with everything it owns."""

    worker: PrefillWorker | DecodeWorker
    loop: EngineLoop
    kv_manager: BaseKVManager
    membership: Membership | None = None   # the fleet's registry (None: none configured)
    announced: Member | None = None        # what this worker announced there (after ``start``)
    instance_id: str = ""
    model_name: str = ""
    grpc_url: str = ""
    _stop_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stopped: bool = False

    def start(self) -> None:
        self.kv_manager.start()
        self.loop.start()
        if self.membership is not None:   # routers may pair it from now on
            role = "prefill" if isinstance(self.worker, PrefillWorker) else "decode"
            self.announced = Member(self.instance_id, role, self.grpc_url, self.model_name,
                                    self.kv_manager.rendezvous_url, self.kv_manager.epoch)
            self.membership.announce(self.announced, ttl_s=MEMBER_TTL_S)
            self.membership.start()

    @property
    def kv_manager_epoch(self) -> int:
        """The KV manager's epoch (after ``start``): changes with every start of the instance."""
        return self.kv_manager.epoch

    def withdraw(self, timeout_s: float = 2.0) -> None:
        """Leave the fleet: out of its registry, and listed as draining at this worker's own rendezvous
        (routers stop pairing it within one refresh, also those that find their workers through their server's
        repository index, which then ask the model again and find a reloaded successor); the worker keeps
        serving what it has. Idempotent; ``stop`` does it too."""
        self.kv_manager.set_draining()
        membership, self.membership = self.membership, None
        if membership is not None:
            membership.stop(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Idempotent and thread-safe (the server watch and ``finalize`` may both call it): a second call
        waits for the first to finish. Returns False if the engine loop did not stop within ``timeout_s``."""
        with self._stop_lock:
            if self._stopped:
                return True
            self._stopped = True
            self.withdraw(min(timeout_s, 2.0))   # no router pairs it any more (within one refresh)
            stopped = self.loop.stop(timeout_s)
            self.worker.fail_all("the worker is shutting down")
            self.kv_manager.shutdown(timeout_s)
            return stopped


def create_pd_worker(role: str, config: WorkerConfig, instance_id: str,
                     metrics: ServingMetrics | None = None, model_name: str = "",
                     worker_endpoint: str = "",
                     on_fatal: Callable[[EngineError], None] | None = None) -> PDWorkerHandle:
    """Load the model and build a ``"prefill"`` or ``"decode"`` worker (nothing started), known to its peers
    as ``instance_id`` serving ``model_name`` at ``config.grpc_url`` (and at ``worker_endpoint``, the address
    of its own ``serving.workers.endpoint``, when not empty). ``on_fatal``: as ``EngineLoop``'s (the engine
    failed for good, e.g. a tensor-parallel rank died).

    Raises:
        ValueError: ``role`` is neither ``"prefill"`` nor ``"decode"``.
        ConfigError: ``tensor_parallel_size`` or ``expert_parallel_size`` > 1 on a GPU (the KV transfer
            registers every rank's pool in rank 0's process, which a GPU rank's device memory is not:
            docs/parallelism.md).
        engine.model.errors.ModelLoadError: the model cannot be loaded.
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    ranks_field = "tensor_parallel_size" if config.tensor_parallel_size > 1 else "expert_parallel_size"
    if getattr(config, ranks_field) > 1 and config.device.startswith("cuda"):
        raise ConfigError(ranks_field,
                          f"must be 1 for {role} models on a GPU, got {getattr(config, ranks_field)}: the KV "
                          "transfer moves the ranks' pools from rank 0's process, which reaches host memory "
                          "only (colocated models take it)")
    from engine import LLMEngine  # heavy import (torch): only when a worker is built

    engine = LLMEngine(config.engine_config("prefill" if role == "prefill" else "decode"))
    loop = EngineLoop(engine, name=f"{instance_id}-engine-loop", idle_wait_s=config.idle_wait_s,
                      nice=config.engine_nice, on_fatal=on_fatal)
    kv_manager = make_kv_manager(kv_args(config, engine, instance_id, role, model_name, worker_endpoint),
                                 backend=config.kv_backend, options=config.kv_options)
    worker: PrefillWorker | DecodeWorker
    if role == "prefill":
        worker = PrefillWorker(loop, engine, engine.tokenizer, kv_manager, config.page_size,
                               name=instance_id, metrics=metrics)
    else:
        worker = DecodeWorker(loop, engine, engine.tokenizer, kv_manager, name=instance_id, metrics=metrics,
                              page_size=config.page_size)
    kv_manager.set_load_source(lambda: worker.load)
    if metrics is not None:
        loop.add_hook(LoopMetricsHook(loop, metrics, lambda: (engine.num_free_pages, engine.num_total_pages),
                                        prefix_cache=engine.prefix_cache_stats))
        if engine.config.dp_size > 1:
            loop.add_hook(DPRankMetricsHook(metrics, lambda: engine.rank_free_pages, lambda: engine.dp_loads))
        loop.add_hook(KVMetricsHook(kv_manager, metrics, worker))
    membership = make_membership(config.registry_url, config.fleet_secret, config.etcd_settings,
                                 tls=config.fleet_tls)
    return PDWorkerHandle(worker, loop, kv_manager, membership,
                          instance_id=instance_id, model_name=model_name, grpc_url=config.grpc_url)
