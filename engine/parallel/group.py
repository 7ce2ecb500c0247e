"""``TensorParallelGroup``: rank 0's side of a tensor-parallel engine (its rank processes, their group, the
step broadcast), and ``ParallelCausalLM``, the model the engine's runner calls.

Lifecycle (``LLMEngine`` drives it; all on the thread that builds and closes the engine, but ``forward``):

1. ``start(config)``: resolve the model folder, check ``tensor_parallel_size`` against its heads, size the KV
   pool (``num_pages``: the same page ids on every rank), open a TCP store on loopback (port 0) and, for the
   CPU, the shared region (``engine.parallel.shm``) and a memfd per rank 1..N-1 for its KV pool, mapped here
   too (``rank_pools``: the KV transfer reaches every rank's heads from this process); start ranks 1..N-1
   (``python -m engine.parallel.rank_worker``, stdin a pipe only this process writes), load rank 0's own
   slice meanwhile, join the process group once every rank said hello, wait until every rank is ready (each
   wait also watches the processes: a rank that exits fails the start at once, naming it), attach the
   communicator, start the rank watch (a daemon thread, ``tp-rank-watch``).
2. ``ParallelCausalLM.forward`` (the engine thread, once per step): broadcast the step, run rank 0's slice;
   its all-reduces meet the other ranks', the logits come back whole.
3. A rank process that exits while serving: the rank watch (every 50 ms) aborts the communicator with the
   rank's exit status, so a collective waiting on it fails at once; the step raises ``TensorParallelError``
   and so does every later one; the other rank processes are killed. A rank that stops answering: the
   collective times out after ``tp_timeout_s``, same outcome. An expert-parallel engine's MoE exchanges fail
   the same way: through the shared region they are the communicator's own operations; over the process
   group (``moe_dispatcher`` "all_to_all", or ranks without shared-memory collectives) at once when a rank's
   connection closes, after ``tp_timeout_s`` when it hangs.
4. ``stop()``: send ``STOP``, reap the processes (killed after a deadline), stop the watch, close the region
   and the store. Idempotent. The rank processes also end by themselves when this process ends (their stdin
   pipe closes), so no path leaves one behind; the region is a memfd, so none leaves shared memory behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.errors import TensorParallelError
from engine.forward_batch import DPShares, ForwardBatch
from engine.kv_pool import KVPool, KVShape, shared_pool_fd
from engine.model.config import ModelConfig
from engine.model.moe_dispatch import DispatchError
from engine.parallel.communicator import CollectiveError, Communicator
from engine.parallel.layout import KVHeadSlice, RankShard, dp_attention_shard, shard_for
from engine.parallel.spec import START_TIMEOUT_S, STORE_HOST, RankSpec, make_communicator, moe_exchange_comm
from engine.parallel.step import encode_dp_step, encode_step, encode_stop
from engine.parallel.torch_comm import open_process_group

if TYPE_CHECKING:
    from engine.model import LoadedModel

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05
#: how long a failed MoE exchange waits for a rank process's exit to become visible, to name the rank
EXIT_SEEN_S = 0.5
STOP_TIMEOUT_S = 10.0
_REPO_ROOT = Path(__file__).resolve().parents[2]


class TensorParallelGroup:
    """Rank 0's handle on the ranks of one engine. Build it with ``start``.

    Attributes:
        world_size: ranks in the group (``tensor_parallel_size``).
        loaded: rank 0's ``engine.model.LoadedModel`` (its slice of the model; tokenizer, full config).
        model: the ``ParallelCausalLM`` the engine's runner calls.
        kv_heads: the KV heads rank 0's pool holds.
        num_pages: pages of every rank's KV pool.
        comm: rank 0's communicator (its ``stats`` say where collective time goes).
        rank_pids: process ids of ranks 1..N-1.
        rank_pools: on the CPU, ranks 1..N-1's KV pools as rank 0 maps them (``KVPool`` over each rank's
            memfd: the same bytes the rank writes), in rank order, so that rank 0's KV transfer agent
            registers every rank's heads; empty on GPUs (each rank's pool is its device's) and with DP
            attention.
        dp_region_fd: DP attention on the CPU: the memfd holding every rank's pool back to back (rank r's:
            pages ``[r * num_pages, (r + 1) * num_pages)``, rank 0's included), which the engine maps for
            rank 0's pool and, whole, for its KV transfer; -1 otherwise.
        failure: why the group failed (None while healthy).
    """

    def __init__(self, config: EngineConfig, shards: list[RankShard], num_pages: int) -> None:
        self.world_size = config.num_ranks
        self.shards = shards
        self.kv_heads: KVHeadSlice = shards[0].kv_heads
        self.num_pages = num_pages
        self.failure: str | None = None
        self.loaded: LoadedModel | None = None
        self.model: ParallelCausalLM | None = None
        self.comm: Communicator | None = None
        self._config = config
        self._procs: list[subprocess.Popen[bytes]] = []
        self._store: dist.TCPStore | None = None
        self._region_fd = -1
        self.rank_pools: list[KVPool] = []
        self._kv_fds: list[int] = []
        self.dp_region_fd = -1
        self._stopping = threading.Event()
        self._joined = False   # every rank loaded and reached "ready": it now takes steps (and STOP)
        self._watch: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        """``"expert-parallel"`` for an MoE instance's ranks, else ``"tensor-parallel"`` (error messages)."""
        return "expert-parallel" if self._config.expert_parallel_size > 1 else "tensor-parallel"

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- start ---------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig) -> TensorParallelGroup:
        """Start the ranks of ``config`` (``tensor_parallel_size`` > 1) and load rank 0's slice (seconds).

        Raises:
            ValueError: ``tensor_parallel_size`` does not fit the model's heads, or the model is not a dense
                Llama-family one; ``expert_parallel_size`` does not fit its experts or heads, or the model has
                no experts (the message names the field).
            engine.model.ModelLoadError: the model cannot be loaded.
            TensorParallelError: a rank process exited or did not join within ``START_TIMEOUT_S``.
        """
        from engine.model.hf_folder import read_hf_config
        from engine.model.loader import resolve_model_folder

        folder = resolve_model_folder(config.model, config.cache_dir)
        mc = read_hf_config(folder / "config.json", model_id=folder.name.lower())
        n = config.num_ranks
        if config.expert_parallel_size > 1:   # an MoE model: experts spread, the rest tensor-parallel
            from engine.model.moe_lm import check_expert_parallel_size

            check_expert_parallel_size(mc, n, config.enable_dp_attention)
        elif getattr(mc, "moe", None) is not None or getattr(mc, "mla", None) is not None:
            raise ValueError(f"tensor_parallel_size={n} is not supported for {mc.architecture}: the ranks "
                             "split dense Llama-family models only (expert_parallel_size splits MoE models)")
        cut = dp_attention_shard if config.enable_dp_attention else shard_for
        shards = [cut(mc, r, n) for r in range(n)]
        group = cls(config, shards, _num_pages(config, mc, shards))
        try:
            group._launch(folder, mc)
        except BaseException:
            group.stop()
            raise
        return group

    def _launch(self, folder: Path, mc: ModelConfig) -> None:
        from engine.model import load_model

        config, n = self._config, self.world_size
        self._store = dist.TCPStore(STORE_HOST, 0, n, True, timedelta(seconds=START_TIMEOUT_S),
                                    wait_for_workers=False)
        collectives = _collectives(config)
        moe_exchange = _moe_exchange(config, mc, collectives)
        buffer_bytes = _buffer_bytes(config, mc, self.shards, moe_exchange)
        if collectives == "shm":
            from engine.parallel.shm import create_region

            self._region_fd = create_region(n, buffer_bytes)
        widths = tuple(len(s.vocab) for s in self.shards)
        on_cpu = torch.device(config.device).type == "cpu"
        if on_cpu and config.enable_dp_attention:
            self._make_dp_region(mc)
        elif on_cpu:
            self._map_rank_pools(mc)
        kv_fds = [-1, *self._kv_fds] if self._kv_fds else [-1] * n
        region_pages = 0
        if self.dp_region_fd >= 0:
            kv_fds, region_pages = [self.dp_region_fd] * n, n * self.num_pages
        specs = [RankSpec(r, n, str(folder), _rank_device(config.device, r), config.dtype,
                          config.weight_quant, config.num_threads, config.page_size, self.num_pages,
                          self._store.port, collectives, self._region_fd, buffer_bytes, widths,
                          config.tp_timeout_s, kv_fds[r], config.expert_parallel_size,
                          config.enable_dp_attention, r * self.num_pages if region_pages else 0, region_pages,
                          moe_exchange)
                 for r in range(n)]
        for spec in specs[1:]:
            self._procs.append(_spawn(spec, self._region_fd, spec.kv_fd))
        logger.info("%s: started ranks 1..%d (pids %s), %s collectives, %d pages per rank%s",
                    self.kind, n - 1, self.rank_pids, collectives, self.num_pages,
                    f", MoE exchange {moe_exchange}" if config.expert_parallel_size > 1 else "")
        if config.expert_parallel_size > 1:   # its exchanges need the group at load: join first
            self._wait_keys("hello")
            process_group = open_process_group(self._store, 0, n, torch.device(config.device))
            self.comm = make_communicator(specs[0], process_group, self._region_fd)
            loaded = self.loaded = load_model(str(folder), dtype=getattr(torch, config.dtype),
                                              device=config.device, weight_quant=config.weight_quant,
                                              expert_group=process_group,
                                              expert_timeout_s=config.tp_timeout_s,
                                              dp_attention=config.enable_dp_attention,
                                              expert_comm=moe_exchange_comm(specs[0], self.comm))
        else:
            loaded = self.loaded = load_model(str(folder), dtype=getattr(torch, config.dtype),
                                              device=config.device, weight_quant=config.weight_quant, rank=0,
                                              tensor_parallel_size=n, dp_attention=config.enable_dp_attention)
            self._wait_keys("hello")
            process_group = open_process_group(self._store, 0, n, torch.device(config.device))
            self.comm = make_communicator(specs[0], process_group, self._region_fd)
        self._wait_keys("ready")
        self._joined = True
        loaded.model.attach(self.comm)
        self.model = ParallelCausalLM(loaded.model, self)
        self._watch = threading.Thread(target=self._watch_ranks, name="tp-rank-watch", daemon=True)
        self._watch.start()

    def _map_rank_pools(self, mc: ModelConfig) -> None:
        """A memfd per rank 1..N-1 holding its KV pool, mapped here too (``rank_pools``)."""
        dtype = getattr(torch, self._config.dtype)
        for shard in self.shards[1:]:
            shape = KVShape(mc.num_layers, shard.num_kv_heads, mc.head_dim, self._config.page_size,
                            mc.kv_layout_kind)
            fd = shared_pool_fd(self.num_pages * shape.page_bytes(dtype))
            self._kv_fds.append(fd)
            self.rank_pools.append(KVPool(shape, self.num_pages, dtype, "cpu", shared_fd=fd))

    def _make_dp_region(self, mc: ModelConfig) -> None:
        """One memfd holding every DP rank's pool back to back (``dp_region_fd``); each rank maps it whole and
        uses its own pages."""
        config = self._config
        shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.page_size, mc.kv_layout_kind)
        fd = shared_pool_fd(self.world_size * self.num_pages * shape.page_bytes(getattr(torch, config.dtype)))
        self._kv_fds.append(fd)
        self.dp_region_fd = fd

    def _wait_keys(self, stage: str) -> None:
        """Wait until every rank set ``<stage>/<rank>`` in the store, failing at once when one exits."""
        assert self._store is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.world_size):
            while not self._store.check([f"{stage}/{rank}"]):
                dead = self._exited()
                if dead:
                    raise TensorParallelError(f"{dead} while starting (its log says why)", self.kind)
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"rank {rank} did not reach '{stage}' within "
                                              f"{START_TIMEOUT_S:g} s", self.kind)
                time.sleep(0.02)

    # ---- serving -------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``TensorParallelError`` when the group has failed (any thread)."""
        if self.failure is not None:
            raise TensorParallelError(self.failure, self.kind)

    def fail(self, reason: str) -> TensorParallelError:
        """Mark the group failed (the first reason stays), abort the communicator, kill the rank processes;
        returns the error to raise. Any thread."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            logger.error("%s group failed: %s", self.kind, reason)
            if self.comm is not None:
                self.comm.abort(reason)
            self._kill()
        return TensorParallelError(self.failure or reason, self.kind)

    def explain(self, error: Exception) -> str:
        """``error``'s text, led by the rank process that exited if one did: an MoE all-to-all (gloo or
        NCCL, not the communicator: ``moe_dispatcher`` "all_to_all") ends with the transport's words
        ("Connection closed by peer") when a rank dies inside it, before the rank watch names the rank. A
        dying process closes its sockets before its exit status can be read, so this waits up to
        ``EXIT_SEEN_S`` for one (the engine thread, on the failure path only)."""
        deadline = time.monotonic() + EXIT_SEEN_S
        dead = self._exited()
        while dead is None and isinstance(error, DispatchError) and time.monotonic() < deadline:
            time.sleep(0.01)
            dead = self._exited()
        return f"{dead} ({error})" if dead and dead not in str(error) else str(error)

    def _watch_ranks(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            dead = self._exited()
            if dead:
                self.fail(dead)
                return

    def _exited(self) -> str | None:
        """'rank r (pid p) was killed by signal s' (or 'exited with status c') for the first rank process
        that has exited, else None."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return f"rank {rank} (pid {proc.pid}) {how}"
        return None

    def set_nice(self, nice: int) -> bool:
        """Give every thread of the rank processes nice value ``nice`` (the engine loop thread's, so that
        under load no rank is preempted more than rank 0: every step waits for its slowest rank). Returns
        False (logged) when the kernel refused it (a nice below the process's needs ``CAP_SYS_NICE``)."""
        for pid in self.rank_pids:
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
            except PermissionError as e:
                logger.warning("%s: rank processes keep their nice (%s)", self.kind, e.strerror)
                return False
            except (FileNotFoundError, ProcessLookupError):   # a rank that exits: the watch reports it
                continue
        return True

    # ---- stop ----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every rank process and release the region and the store; idempotent. Call it after the engine
        thread stopped stepping (it sends ``STOP`` through the communicator when the group is healthy)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._joined and self.failure is None and all(p.poll() is None for p in self._procs):
            assert self.comm is not None
            try:
                self.comm.broadcast_step(encode_stop())
            except CollectiveError as e:
                logger.warning("%s: STOP not delivered (%s); killing the ranks", self.kind, e)
                self._kill()
        else:   # a failed start (a rank may still be loading) or a failed group: nothing to say to the ranks
            self._kill()
        _reap(self._procs, STOP_TIMEOUT_S)
        if self._watch is not None:
            self._watch.join(1.0)
        if self.comm is not None:
            self.comm.close()
        if self._region_fd >= 0:
            os.close(self._region_fd)
            self._region_fd = -1
        for fd in self._kv_fds:   # the mappings (rank_pools) stay valid until dropped: a transfer agent may
            os.close(fd)          # still hold them registered until its manager shut down
        self._kv_fds = []
        self.dp_region_fd = -1
        self._store = None
        logger.info("%s: ranks stopped", self.kind)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()


class ParallelCausalLM:
    """The ``CausalLM`` of a tensor-parallel engine (rank 0): each ``forward`` broadcasts the step to the
    other ranks and runs rank 0's slice; the logits it returns are whole (gathered)."""

    def __init__(self, model: torch.nn.Module, group: TensorParallelGroup) -> None:
        self._model = model
        self._group = group

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """``[len(batch.logits_indices), vocab_size]`` float32 logits (as ``LlamaForCausalLM.forward``).

        Raises:
            TensorParallelError: the group has failed, or fails during this step (a rank died or timed out).
        """
        group = self._group
        group.check()
        assert group.comm is not None
        try:
            group.comm.broadcast_step(encode_step(batch))
            return self._model.forward(batch, kv_cache)
        except (CollectiveError, DispatchError) as e:
            raise group.fail(group.explain(e)) from None
        except BaseException as e:
            group.fail(f"rank 0 failed inside a step: {e!r}")
            raise

    def forward_ranks(self, batches: list[ForwardBatch], kv_cache: torch.Tensor) -> torch.Tensor:
        """One step of a DP-attention engine (``engine.model_runner.DataParallelLM``): ``batches[r]`` is rank
        r's own batch (an empty one: the rank runs an idle batch, taking part in every collective), rank 0's
        run here over ``kv_cache``.

        Returns:
            ``[sum of the batches' logits rows, vocab_size]`` float32, rank 0's rows first.
        Raises:
            TensorParallelError: as ``forward``.
        """
        group = self._group
        group.check()
        assert group.comm is not None and len(batches) == group.world_size
        own = batches[0]
        own.dp = DPShares(0, tuple(b.num_tokens for b in batches),
                          tuple(int(b.logits_indices.shape[0]) for b in batches))
        try:
            group.comm.broadcast_step(encode_dp_step(batches))
            return self._model.forward(own, kv_cache)
        except (CollectiveError, DispatchError) as e:
            raise group.fail(group.explain(e)) from None
        except BaseException as e:
            group.fail(f"rank 0 failed inside a step: {e!r}")
            raise


def _num_pages(config: EngineConfig, mc: ModelConfig, shards: list[RankShard]) -> int:
    """Pages of every rank's pool: ``num_pages``, or what ``kv_cache_bytes`` holds on the rank with the most
    KV heads (so no rank exceeds it)."""
    if config.num_pages:
        return config.num_pages
    most = max(s.num_kv_heads for s in shards)
    return KVShape(mc.num_layers, most, mc.head_dim, config.page_size, mc.kv_layout_kind).pages_for_bytes(
        config.pool_bytes, getattr(torch, config.dtype))


def _buffer_bytes(config: EngineConfig, mc: ModelConfig, shards: list[RankShard], moe_exchange: str) -> int:
    """Slot size of the shared region: one step's all-reduce (``max_num_batched_tokens`` rows of the hidden
    size), a 64-row logits gather, or with ``moe_exchange`` ``"shm"`` one step's MoE exchange
    (``_moe_slot_bytes``), whichever is larger, in whole 4 KiB (larger all-reduces and gathers go in pieces;
    an MoE exchange never does)."""
    itemsize = getattr(torch, config.dtype).itemsize
    ranks_tokens = config.dp_size   # DP attention: an exchange holds every rank's tokens
    largest = max(ranks_tokens * config.max_num_batched_tokens * mc.hidden_size * itemsize,
                  64 * max(len(s.vocab) for s in shards) * 4, 1 << 16,
                  _moe_slot_bytes(config, mc) if moe_exchange == "shm" else 0)
    return -(-largest // 4096) * 4096


#: the largest slot (bytes) ``moe_dispatcher`` "auto" gives the shared-memory MoE exchange; the region holds
#: 2 slots per rank, touched only as far as steps fill them. Above it (large models, large token budgets)
#: "auto" takes the all-to-all. 256 MiB: the tiny test models need ~0.1-4 MiB, DeepSeek-V3's shapes in bf16
#: 117 KiB per token of a step's budget.
MOE_SHM_SLOT_CAP = 256 << 20


def _moe_slot_bytes(config: EngineConfig, mc: ModelConfig) -> int:
    """One step's MoE exchange for ``SharedMemoryDispatcher`` (``exchange_bytes``): at most
    ``dp_size * max_num_batched_tokens`` tokens in a step over all ranks, each routed to ``top_k`` experts."""
    from engine.model.shm_dispatch import exchange_bytes

    assert mc.moe is not None
    itemsize = getattr(torch, config.dtype).itemsize
    return exchange_bytes(mc.moe.num_experts, mc.moe.top_k, mc.hidden_size, itemsize,
                          config.dp_size * config.max_num_batched_tokens)


def _moe_exchange(config: EngineConfig, mc: ModelConfig, collectives: str) -> str:
    """``"shm"`` or ``"all_to_all"`` for an expert-parallel instance (``EngineConfig.moe_dispatcher``);
    ``"all_to_all"`` when the instance is not expert-parallel.

    Raises:
        ValueError: ``moe_dispatcher`` ``"shm"`` where it cannot run (no shared-memory collectives, or one
            step's exchange over ``MOE_SHM_SLOT_CAP``), naming the field.
    """
    if config.expert_parallel_size == 1 or config.moe_dispatcher == "all_to_all":
        return "all_to_all"
    need = _moe_slot_bytes(config, mc)
    if collectives == "shm" and need <= MOE_SHM_SLOT_CAP:
        return "shm"
    why = ("the ranks' collectives are not shared memory" if collectives != "shm" else
           f"one step's exchange needs {need} bytes per slot, over MOE_SHM_SLOT_CAP ({MOE_SHM_SLOT_CAP}); "
           "lower max_num_batched_tokens")
    if config.moe_dispatcher == "shm":
        raise ValueError(f"moe_dispatcher='shm' cannot be used: {why}")
    logger.info("expert parallel: MoE exchange over all_to_all_single: %s", why)
    return "all_to_all"


def _collectives(config: EngineConfig) -> str:
    """``"shm"`` for CPU ranks when ``shm_sync.c`` builds (``tp_collectives`` ``auto`` or ``shm``), else
    ``"torch"`` (gloo on the CPU, NCCL on GPUs)."""
    if torch.device(config.device).type != "cpu" or config.tp_collectives == "gloo":
        return "torch"
    try:
        from engine.parallel.shm import shm_sync_library

        shm_sync_library()
        return "shm"
    except (OSError, subprocess.SubprocessError) as e:
        if config.tp_collectives == "shm":
            raise
        logger.warning("tensor parallel: shared-memory collectives unavailable (%s); using gloo's", e)
        return "torch"


def _rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the engine's for the CPU; for ``cuda:<i>``, ``cuda:<i + rank>`` (one rank per
    device, the instance's devices consecutive)."""
    d = torch.device(device)
    return device if d.type != "cuda" else f"cuda:{(d.index or 0) + rank}"


def _python() -> str:
    """The interpreter for rank processes: a python-backend stub embeds Python, so ``sys.executable`` may name
    the stub binary; then the ``python3`` on PATH (the one the stub was started with)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


def _spawn(spec: RankSpec, region_fd: int, kv_fd: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([_python(), "-m", "engine.parallel.rank_worker", "--spec", spec.to_json()],
                            stdin=subprocess.PIPE, env=env,
                            pass_fds=tuple(fd for fd in (region_fd, kv_fd) if fd >= 0))


def _reap(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for the rank processes to exit (killed once ``timeout_s`` passed), then close their pipes."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("rank pid %d did not stop; killing it", proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()

