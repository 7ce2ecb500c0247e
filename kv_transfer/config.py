"""Configuration of one KV manager, built once at the edge and passed down (frozen)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer.head_slices import KVRegion, coverage_problem
from kv_transfer.layout import KVLayout

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class KVArgs:
    """Everything a manager needs: its identity, its KV region and layout, its rendezvous, its timeouts.

    ``kv_base_ptr``/``kv_nbytes`` describe the engine's page-major pool
    ``[num_pages, num_kv_heads, num_layers, 2, page_size, head_dim]`` (``kv_transfer.layout``); the caller
    owns that memory and keeps it alive until ``shutdown()``. A tensor-parallel engine gives ``kv_regions``
    instead (every rank's pool, ``kv_transfer.head_slices``, rank 0 first): ``kv_base_ptr`` is then the first
    region's, ``kv_nbytes`` the sum of the regions' pool bytes and ``layout.num_kv_heads`` the model's KV
    heads.
    """

    instance_id: str
    role: str
    kv_base_ptr: int
    kv_nbytes: int
    layout: KVLayout
    model_id: str
    bootstrap_timeout_s: float = 30.0      # prefill: decode never posted a destination; decode: no prefill
    waiting_timeout_s: float = 30.0        # decode: no chunk for this long after the destination went out
    mem_type: str = "DRAM"                 # "VRAM" for a CUDA pool
    device_id: int = 0
    address: str = ""                      # Triton gRPC endpoint (host:port) serving ``model_name``: routers
    model_name: str = ""                   # send requests there (in our registration, never used here)
    worker_endpoint: str = ""              # the worker's own gRPC endpoint (host:port; "": none): routers
                                           # send its child requests there instead (serving.workers.endpoint)
    aux_slots: int = 1024                  # concurrent rooms per instance
    heartbeat_interval_s: float = 1.0
    peer_check_interval_s: float = 1.0     # how often peers with open rooms are checked at their rendezvous
    peer_lost_s: float = 10.0              # a peer whose rendezvous does not answer this long is lost (a
                                           # refused connection: at once)
    rendezvous_port: int = 0               # our rendezvous server's port on ``local_hostname`` (0: a
                                           # free one)
    fleet_secret: bytes | None = None      # HMAC key of rendezvous calls (bootstrap.auth); None:
                                           # loopback only
    fleet_tls: FleetTLS | None = None      # the rendezvous serves HTTPS, peers' are dialed so (bootstrap.tls)
    bootstrap_poll_interval_s: float = 0.005   # prefill: destination polling while a sender waits
    idle_poll_interval_s: float = 0.1          # prefill: destination polling with no sender waiting
    active_tick_s: float = 0.0002          # thread wait while transfers are open
    idle_tick_s: float = 0.02              # thread wait with nothing open
    http_timeout_s: float = 2.0
    # True: ``send(is_last=True)`` posts the last chunk's WRITE and ``poll`` drains notifications in the
    # caller's thread, so the KV's last leg has no hop to a manager thread in it (docs/protocol.md, "Inline
    # progress"); False: all transport work on the manager threads
    inline_progress: bool = True
    # the address peers reach this instance's transport and rendezvous at (NIXL: its interface becomes
    # UCX_NET_DEVICES, kv_transfer.network; Mooncake: the address it advertises). A backend's own options (its
    # protocol, its devices, ...) are not here: ``kv_transfer.backends.make_transport`` takes them.
    local_hostname: str = "127.0.0.1"
    kv_regions: tuple[KVRegion, ...] = ()

    @property
    def queued_keepalive_s(self) -> float:
        """How often a prefill tells a decode that a room with its destination in, and no chunk yet, is still
        queued here (a ``queued`` notification), seconds: a quarter of the waiting timeout, at most 5 s, so a
        decode with the same timeout hears it several times per window."""
        return min(5.0, self.waiting_timeout_s / 4)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"KVArgs.role must be one of {ROLES}, got {self.role!r}")
        pool_bytes = sum(r.layout(self.layout).pool_bytes for r in self.kv_regions) if self.kv_regions \
            else self.layout.pool_bytes
        if self.kv_nbytes != pool_bytes:
            raise ValueError(f"KVArgs.kv_nbytes {self.kv_nbytes} != layout pool bytes {pool_bytes}")
        problem = coverage_problem(self.kv_regions, self.layout.num_kv_heads) if self.kv_regions else None
        if problem is not None:
            raise ValueError(f"KVArgs.kv_regions: {problem}")
        if self.kv_regions and (self.kv_regions[0].base_ptr != self.kv_base_ptr or self.mem_type != "DRAM"):
            raise ValueError("KVArgs.kv_regions: the first region must be kv_base_ptr's, in host memory "
                             "(GPU ranks' pools are each on their own device: not supported)")
        if self.kv_base_ptr <= 0:
            raise ValueError("KVArgs.kv_base_ptr must be a valid address")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s",
                     "peer_check_interval_s", "peer_lost_s", "bootstrap_poll_interval_s",
                     "idle_poll_interval_s", "active_tick_s", "idle_tick_s", "http_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVArgs.{name} must be positive")
        if self.aux_slots <= 0:
            raise ValueError("KVArgs.aux_slots must be positive")
        if not self.local_hostname:
            raise ValueError("KVArgs.local_hostname must not be empty")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"KVArgs.mem_type must be DRAM or VRAM, got {self.mem_type!r}")
