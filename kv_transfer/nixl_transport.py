"""NIXL transport (UCX backend): the only module that imports nixl.

Facts it relies on (docs/protocol.md has the measurements): memory is registered once; the descriptor list of
every KV block and aux slot is prepared once for ourselves and once per peer (``prep_xfer_dlist``), and each
chunk is one ``make_prepped_xfer`` with index lists — NIXL merges runs contiguous on both sides — which cost
~6 us per request against ~100-300 us for building descriptor lists per chunk; a peer's connection is warmed
up at handshake with a notification (the first transfer to a new peer otherwise pays ~10 ms of lazy set-up);
failures raise (a dead peer gives ``nixlRemoteDisconnectError`` from ``transfer``/``check_xfer_state``).

Progress thread: off on the prefill side (its manager thread posts and polls; a second thread on the same UCX
worker took turns with the posting one, docs/multihost.md) and where every peer is on this host (the writer
copies with ``cma``); on a decode whose KV may come over the network NIXL's progress thread runs, woken by
UCX's events, so a peer's WRITE over TCP lands as its bytes arrive whatever the engine loop's pace (UCX's TCP
transport carries a remote write as messages the target copies in only when its worker is progressed;
docs/multihost.md, "The decode side's progress thread").

Copy threads (host memory): on one host UCX moves the bytes with ``cma`` (``process_vm_writev``), one kernel
copy with cached stores in the posting thread, ~0.55x a streaming memcpy of a 4k prompt's 180 MiB here
(docs/benchmarks.md, "KV transfer"). Where this process may run on two or more cores and every peer is on this
host, the UCX backend gets ``COPY_THREADS`` dedicated threads (NIXL's ``num_threads``) and a WRITE of at least
``SPLIT_MIN_DESCS`` descriptors is posted unmerged, so NIXL splits it between them (it splits by descriptor
count; a merged run is one descriptor). A process pinned to one core (serving's ``cpu_affinity``) keeps the
single-thread path, and so does one whose KV may cross the network (``kv_may_cross_network``): over TCP the
split became two connections' worth of socket writes on the same cores, and a 4k prompt's room took 74-91 ms
against 66-68 ms merged (5 of 5 paired runs, docs/multihost.md "Copy threads over the network").
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kv_transfer import network
from kv_transfer.aux import AUX_SLOT_BYTES
from kv_transfer.blocks import BlockTable
from kv_transfer.config import KVArgs
from kv_transfer.transport import (
    BackendOptions,
    OptionError,
    PeerUnreachable,
    Transport,
    TransportError,
    XferState,
)

logger = logging.getLogger(__name__)
_agent_counter = itertools.count()
LOCAL = "NIXL_INIT_AGENT"   # nixl's name for "this agent" in prep_xfer_dlist

#: Dedicated copy threads of the UCX backend where the process may use that many cores and every peer is on
#: this host (see module docstring).
COPY_THREADS = 2
#: Smallest WRITE (descriptors: pages + aux slot) split between the copy threads; smaller ones (a 128-token
#: chunk is 9) gain less than the hand-off costs.
SPLIT_MIN_DESCS = 16
SPLIT_WAIT_S = 0.25      # longest wait of post_write for a split WRITE: the first one to a peer needs the
#                          peer to progress (the copy threads connect lazily); after it the manager tracks it
SPLIT_POLL_S = 0.00005
#: Longest ``NixlOptions.progress_thread_ms``: the thread's fallback wake-up, not its pace (1 s is plenty).
MAX_PROGRESS_THREAD_MS = 1000.0


def ucx_defaults(local_hostname: str = "127.0.0.1", network_only: bool = False) -> dict[str, str]:
    """The UCX settings for an agent that advertises ``local_hostname``
    (``kv_transfer.network.ucx_settings``): the interface owning that address as ``UCX_NET_DEVICES`` (``lo``
    for loopback), ``UCX_TLS=tcp,self`` with ``network_only``, ``UCX_MM_ERROR_HANDLING=y``, and
    ``UCX_MODULES=^ib`` on a host without RDMA devices.

    Why ``^ib``: the nixl-cu12 wheel bundles its own libnl-route-3
    (``nixl_cu12.libs/libnl-route-3-<hash>.so``); where the system's libibverbs1 is installed (Mooncake's
    set-up installs it), UCX's ``ib`` module loads it, and with it the system's libnl-route-3: two copies of
    libnl in one process, and every process that created a NIXL agent segfaults in the bundled copy at exit
    (reproduced: 3 of 3 without the setting, 0 of 3 with it). Without RDMA devices the ``ib`` module has
    nothing to offer; with them it is left alone.
    """
    return network.ucx_settings(local_hostname, network_only)


def apply_ucx_defaults(local_hostname: str = "127.0.0.1", network_only: bool = False) -> dict[str, str]:
    """``ucx_defaults(...)`` into ``os.environ`` where the operator set nothing
    (``kv_transfer.network.apply``, where this package touches the environment); call before importing nixl.
    Returns the values in force for those keys. UCX reads them when an agent's backend is created, so the
    first agent of a process fixes them for all."""
    return network.apply(ucx_defaults(local_hostname, network_only))


def _nixl_errors() -> tuple[type[BaseException], ...]:
    from nixl import _bindings
    found = tuple(getattr(_bindings, n) for n in dir(_bindings)
                  if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_bindings, n), type))
    return found + (RuntimeError,)


_AGENT_LOCK = threading.Lock()


def _new_agent(name: str, progress_thread_ms: float) -> Any:
    """A ``nixl_agent`` with no backend yet; with ``progress_thread_ms`` > 0, NIXL's progress thread on, its
    longest sleep that many ms. Caller: ``NixlTransport.register`` (any thread).

    Why the bindings' constructor is wrapped: nixl's Python API (``nixl._api.nixl_agent``, 1.5) builds the
    agent's ``nixlAgentConfig`` itself and always sets ``pthrDelay`` (the thread's ``poll()`` timeout, us) to
    0, and a thread with a 0 timeout never sleeps (a whole core, measured: docs/multihost.md). NIXL's UCX
    backend (``nixlUcxSharedThread::run``, src/plugins/ucx/ucx_backend.cpp) polls the workers' event fds with
    that timeout, so with one set the thread sleeps until UCX has something for it. The wrapper sets it on the
    config nixl built, for this one construction; every agent this module makes is made under one lock, so no
    other construction sees the wrapper."""
    from nixl import _api

    if progress_thread_ms <= 0:
        with _AGENT_LOCK:
            return _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    bindings: Any = getattr(_api, "nixlBind", None)   # the C++ bindings module of nixl, when present
    make = getattr(bindings, "nixlAgent", None)
    if make is None:   # not the nixl this was written against: no thread rather than a spinning one
        logger.warning("%s: nixl._api has no nixlBind.nixlAgent; running without a progress thread", name)
        return _new_agent(name, 0.0)
    delay_us = max(1, round(progress_thread_ms * 1000))

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make(agent_name, config)

    with _AGENT_LOCK:
        bindings.nixlAgent = with_delay
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=True, backends=[]))
        finally:
            bindings.nixlAgent = make


def kv_may_cross_network(local_hostname: str, network_only: bool) -> bool:
    """Whether KV this agent writes or receives may travel over the network: ``network_only``, or an
    advertised address other than loopback (peers on other hosts may reach it). True: a decode runs the
    progress thread and no agent gets copy threads (``copy_threads_for``). False: all peers are on this host;
    UCX moves the bytes with ``cma``/shared memory, copied by the writer, so the target has nothing to
    progress (there a progress thread cost 4-20 % of the one-host transfer figures: docs/multihost.md)."""
    return network_only or not network.is_loopback(local_hostname)


def copy_threads_for(mem_type: str, over_network: bool = False) -> int:
    """``COPY_THREADS`` for host memory where the calling thread may run on that many cores, else 0 (the
    backend's plain single-thread path; module docstring); 0 as well with ``over_network`` (the caller's
    ``kv_may_cross_network``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return COPY_THREADS if mem_type == "DRAM" and cores >= COPY_THREADS and not over_network else 0


@dataclass(frozen=True)
class NixlOptions(BackendOptions):
    """NIXL's options (model parameter ``kv_network_only``, overridden by ``PD_KV_NETWORK_ONLY``).

    Attributes:
        network_only: the transport never takes shared memory or cma, even to a peer on the same kernel
            (``UCX_TLS=tcp,self``, ``kv_transfer.network``): for hosts that are network namespaces of one
            machine (docs/multihost.md).
        progress_thread_ms: the decode side's NIXL progress thread (model parameter
            ``kv_progress_thread_ms``, env ``PD_KV_PROGRESS_THREAD_MS``): it sleeps in ``poll()`` on the UCX
            worker's event fd, so it wakes when bytes or messages arrive, and at the latest every this many
            milliseconds (NIXL rounds it up to whole ms; its fallback for a wake-up the fd misses). 0: no
            thread; the decode's manager and engine threads then progress UCX at their own pace, which over
            TCP bounds how fast a WRITE lands (docs/multihost.md). Only a decode whose KV may come over the
            network runs one (``kv_may_cross_network``); prefill never does. Idle cost here: 0.7 % of a core
            at 5 ms (1.0 % at 2, 0.3 % at 10). Raises ``OptionError`` below 0 or above
            ``MAX_PROGRESS_THREAD_MS``.
    """

    ENV: ClassVar[Mapping[str, str]] = {"network_only": "PD_KV_NETWORK_ONLY",
                                        "progress_thread_ms": "PD_KV_PROGRESS_THREAD_MS"}

    network_only: bool = False
    progress_thread_ms: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.progress_thread_ms <= MAX_PROGRESS_THREAD_MS:
            raise OptionError("kv_progress_thread_ms", f"must be 0 (no progress thread) to "
                              f"{MAX_PROGRESS_THREAD_MS:g} ms, got {self.progress_thread_ms!r}")


class NixlTransport(Transport):
    def __init__(self, instance_id: str, mem_type: str = "DRAM", device_id: int = 0,
                 copy_threads: int | None = None, local_hostname: str = "127.0.0.1",
                 network_only: bool = False, progress_thread_ms: float = 0.0) -> None:
        """Cheap: the NIXL agent (and whatever UCX starts with it) is created by ``register``.
        ``copy_threads``: the UCX backend's dedicated copy threads; None: ``copy_threads_for`` (of
        ``mem_type`` and ``kv_may_cross_network``) when ``register`` runs (after serving pinned the process,
        if it does); 0: none. ``local_hostname``: the address peers reach this instance at (its interface is
        UCX's); ``network_only``: no shared memory or cma, even to a peer on this kernel
        (``kv_transfer.network``); ``progress_thread_ms``: > 0 runs NIXL's progress thread with that longest
        sleep (``NixlOptions.progress_thread_ms``; ``create`` gives it to the decode role only), 0 none."""
        # before nixl is imported (``_nixl_errors``): UCX reads some at load
        apply_ucx_defaults(local_hostname, network_only)
        self._hostname = local_hostname
        self._network_only = network_only
        for warning in network.reachability_warnings(local_hostname):
            logger.warning("%s: %s", instance_id, warning)
        self._name = f"{instance_id}#{os.getpid()}-{time.time_ns()}-{next(_agent_counter)}"
        self._mem_type = mem_type
        self._device_id = device_id
        self._errors = _nixl_errors()
        self._agent: Any = None
        self._reg_descs: list[object] = []
        self._local_dlists: list[object] = []
        self._num_kv_descs = 0
        # agent name → (its prepared lists, its number of KV blocks)
        self._peer_dlists: dict[str, tuple[list[object], int]] = {}
        self._copy_threads = copy_threads
        self._progress_thread_ms = progress_thread_ms
        # (agent or LOCAL, area address, area bytes, block bytes) → prepared list of the area's blocks

    @classmethod
    def create(cls, args: KVArgs, options: NixlOptions) -> NixlTransport:
        """The backend's factory (``kv_transfer.backends``): host or GPU memory per ``args.mem_type``, UCX on
        ``args.local_hostname``'s interface; ``options.progress_thread_ms`` on a decode whose KV may come over
        the network (``kv_may_cross_network``), else no progress thread."""
        receiving = args.role == "decode" and kv_may_cross_network(args.local_hostname, options.network_only)
        return cls(args.instance_id, args.mem_type, args.device_id, local_hostname=args.local_hostname,
                   network_only=options.network_only,
                   progress_thread_ms=options.progress_thread_ms if receiving else 0.0)

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, table: BlockTable) -> None:
        """KV in ``mem_type``; the aux region is host memory. In DRAM mode one prepared list covers both;
        in VRAM mode KV and aux get a list each (a NIXL list holds one memory type)."""
        if self._copy_threads is None:
            self._copy_threads = copy_threads_for(self._mem_type,
                                                  kv_may_cross_network(self._hostname, self._network_only))
        self._agent = _new_agent(self._name, self._progress_thread_ms)
        if self._progress_thread_ms > 0:
            logger.info("%s: NIXL progress thread on (woken by UCX events, at the latest every %g ms)",
                        self._name, self._progress_thread_ms)
        params = {"num_threads": str(self._copy_threads),
                  "split_batch_size": str(SPLIT_MIN_DESCS)} if self._copy_threads > 1 else {}
        self._agent.create_backend("UCX", params)
        # every rank's pool of a tensor-parallel instance (head-sliced spans address them), else the one pool
        kv_regions = [(addr, nbytes, self._device_id, "") for addr, nbytes in table.region_spans()]
        aux_region = (table.aux_base_ptr, table.aux_slots * AUX_SLOT_BYTES, 0, "")
        if self._mem_type == "DRAM":
            self._reg_descs = [self._agent.register_memory([*kv_regions, aux_region], "DRAM")]
        else:
            self._reg_descs = [self._agent.register_memory(kv_regions, self._mem_type),
                               self._agent.register_memory([aux_region], "DRAM")]
        self._num_kv_descs = table.num_kv_descs
        self._local_dlists = self._prep(LOCAL, table)

    def _prep(self, agent: str, table: BlockTable) -> list[object]:
        """[combined] in DRAM mode, [kv, aux] in VRAM mode."""
        if self._mem_type == "DRAM":
            return [self._agent.prep_xfer_dlist(agent, table.descriptors(0, table.num_descriptors), "DRAM")]
        kv = table.descriptors(0, table.num_kv_descs, self._device_id)
        aux = table.descriptors(table.num_kv_descs, table.num_descriptors)
        return [self._agent.prep_xfer_dlist(agent, kv, self._mem_type),
                self._agent.prep_xfer_dlist(agent, aux, "DRAM")]

    def _select(self, dlists: list[object], indices: np.ndarray,
                num_kv_descs: int) -> tuple[object, np.ndarray]:
        if len(dlists) == 1:
            return dlists[0], indices
        if (indices < num_kv_descs).all():
            return dlists[0], indices
        if (indices >= num_kv_descs).all():
            return dlists[1], indices - num_kv_descs
        raise TransportError("a write mixes KV blocks and aux slots of different memory types")

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, table: BlockTable) -> str:
        """Raises ``PeerUnreachable`` when UCX cannot connect (loading the peer's address, or the warm-up
        message, fails), naming this side's UCX settings; ``TransportError`` otherwise. A dead peer's stale
        address fails to load too: the rooms that wanted it fail at once rather than retry."""
        try:
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
        except self._errors as exc:
            raise self._unreachable("load the peer's address", exc) from exc
        try:
            self._peer_dlists[name] = (self._prep(name, table), table.num_kv_descs)
        except self._errors as exc:
            self.remove_peer(name)
            raise TransportError(f"cannot add peer {name}: {exc!r}") from exc
        try:
            self._agent.send_notif(name, b"")  # warm-up: opens the connection now, not on the first chunk
        except self._errors as exc:
            self.remove_peer(name)
            raise self._unreachable(f"send to {name}", exc) from exc
        return name

    def _unreachable(self, what: str, exc: BaseException) -> PeerUnreachable:
        settings = ", ".join(f"{k}={network.library_setting(k, '(unset)')}"
                             for k in ("UCX_TLS", "UCX_NET_DEVICES"))
        return PeerUnreachable(f"UCX cannot {what}: {exc!r}; this instance advertises {self._hostname} with "
                               f"{settings} (a peer on another host needs a network transport on the "
                               "interface of that address: docs/multihost.md)")

    def remove_peer(self, agent_name: str) -> None:
        dlists, _ = self._peer_dlists.pop(agent_name, ([], 0))
        try:
            for dlist in dlists:
                self._agent.release_dlist_handle(dlist)
            self._agent.remove_remote_agent(agent_name)
        except self._errors as exc:
            logger.warning("removing peer %s failed: %r", agent_name, exc)

    def post_write(self, peer: str, local_indices: np.ndarray, remote_indices: np.ndarray,
                   notif: bytes) -> object:
        if peer not in self._peer_dlists or not self._local_dlists:
            raise TransportError(f"agent {peer} was not added")
        remote_dlists, remote_kv_blocks = self._peer_dlists[peer]
        local_dlist, local_indices = self._select(self._local_dlists, local_indices, self._num_kv_descs)
        remote_dlist, remote_indices = self._select(remote_dlists, remote_indices, remote_kv_blocks)
        handle = None
        try:
            split = (self._copy_threads or 0) > 1 and len(local_indices) >= SPLIT_MIN_DESCS
            handle = self._agent.make_prepped_xfer("WRITE", local_dlist, local_indices, remote_dlist,
                                                   remote_indices, notif, skip_desc_merge=split)
            if self._agent.transfer(handle) == "ERR":
                raise TransportError(f"transfer to {peer} returned ERR")
            if split:
                self._wait_split(handle)
        except self._errors as exc:
            if handle is not None:
                self._safe_release(handle)
            raise TransportError(f"write to {peer} failed: {exc!r}") from exc
        return handle

    def post_write_spans(self, peer: str, local_spans: np.ndarray, remote_spans: np.ndarray,
                         notif: bytes) -> object:
        """One ``initialize_xfer`` over ad-hoc descriptors (NIXL validates them against the registered regions
        and merges what is contiguous); ~20 us more than a prepared transfer, so only for what the prepared
        lists cannot name."""
        if peer not in self._peer_dlists or not self._local_dlists:
            raise TransportError(f"agent {peer} was not added")
        if len(local_spans) != len(remote_spans) or not np.array_equal(local_spans[:, 1], remote_spans[:, 1]):
            raise TransportError("local and remote spans differ in count or size")
        device = np.full((len(local_spans), 1), self._device_id if self._mem_type != "DRAM" else 0,
                         dtype=np.int64)
        handle = None
        try:
            local = self._agent.get_xfer_descs(np.hstack([local_spans, device]), self._mem_type)
            remote = self._agent.get_xfer_descs(np.hstack([remote_spans, device]), self._mem_type)
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
            if self._agent.transfer(handle) == "ERR":
                raise TransportError(f"transfer to {peer} returned ERR")
            if (self._copy_threads or 0) > 1 and len(local_spans) >= SPLIT_MIN_DESCS:
                self._wait_split(handle)   # NIXL may split it between the copy threads, as post_write's
        except self._errors as exc:
            if handle is not None:
                self._safe_release(handle)
            raise TransportError(f"write to {peer} failed: {exc!r}") from exc
        return handle

    def _wait_split(self, handle: object) -> None:
        """Waits (sleeping, so the copy threads keep the cores) until a split WRITE is done, up to
        ``SPLIT_WAIT_S``: NIXL sends its notification only from a ``check_xfer_state`` that sees every chunk
        done, which would otherwise wait for the manager's next tick. Like the single-thread path, where the
        copy runs inside ``transfer``, the WRITE is then complete when ``post_write`` returns. Never raises:
        the WRITE is posted, and a failure shows in the caller's next ``check``."""
        deadline_s = time.monotonic() + SPLIT_WAIT_S
        try:
            while self._agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline_s:
                time.sleep(SPLIT_POLL_S)
        except self._errors as exc:
            logger.warning("check_xfer_state of a split write failed: %r", exc)

    def check(self, handle: object) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(handle))
        except self._errors as exc:
            logger.warning("check_xfer_state failed: %r", exc)
            return XferState.ERR

    def release(self, handle: object) -> None:
        self._safe_release(handle)

    def send_notif(self, peer: str, notif: bytes) -> None:
        try:
            self._agent.send_notif(peer, notif)
        except self._errors as exc:
            raise TransportError(f"notification to {peer} failed: {exc!r}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for sender, messages in self._agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((name, bytes(m)) for m in messages if m)
        return out

    def close(self) -> None:
        if self._agent is None:
            return
        for name in list(self._peer_dlists):
            self.remove_peer(name)
        try:
            for dlist in self._local_dlists:
                self._agent.release_dlist_handle(dlist)
            for descs in self._reg_descs:
                self._agent.deregister_memory(descs)
        except self._errors as exc:
            logger.warning("releasing registered memory failed: %r", exc)
        self._local_dlists, self._reg_descs = [], []
        # the last reference: the agent (its UCX workers and threads) is destroyed now, in the caller's
        # shutdown, not whenever the interpreter gets to it while the Triton stub tears down
        self._agent = None

    def _safe_release(self, handle: object) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except self._errors as exc:
            logger.warning("release_xfer_handle failed: %r", exc)
