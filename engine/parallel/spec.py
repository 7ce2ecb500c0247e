"""``RankSpec``: everything a rank process needs to join its instance, passed on its command line as JSON.

Rank 0 (the engine's process) writes one per rank it starts (``engine.parallel.group``); the rank process
(``python -m engine.parallel.rank_worker --spec ...``) reads it. The same fields build the communicator on
both sides (``make_communicator``), so every rank agrees on slot sizes, widths and timeouts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.parallel.communicator import Communicator

if TYPE_CHECKING:
    from engine.parallel.shm import ShmCommunicator

#: how long rank processes may take to start, load their shard and join (each wait also watches the processes,
#: so a rank that dies fails the start at once)
START_TIMEOUT_S = 600.0
STORE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class RankSpec:
    """One rank's start-up parameters.

    Attributes:
        rank, world_size: this rank of ``world_size`` (``EngineConfig.tensor_parallel_size``).
        model_folder: the HF-style folder every rank loads its slice from (resolved by rank 0, so a GGUF is
            converted once).
        device: the rank's torch device (``"cpu"``; ``"cuda:<n>"``, one rank per device).
        dtype, weight_quant: as ``EngineConfig``.
        num_threads: torch intra-op threads of the rank.
        page_size, num_pages: the KV pool's shape (the same page ids on every rank).
        store_port: rank 0's TCP store on ``STORE_HOST`` (the group's rendezvous).
        collectives: ``"shm"`` (a memfd passed as descriptor ``region_fd``) or ``"torch"`` (the process
            group: gloo or NCCL).
        region_fd: the memfd's descriptor number in the rank process (``"shm"``), else -1.
        buffer_bytes: bytes of each rank's slot in the region.
        logit_widths: vocabulary columns of every rank, in rank order.
        timeout_s: ``EngineConfig.tp_timeout_s``.
        kv_fd: the memfd holding this rank's KV pool, which rank 0 maps too (its KV transfer agent registers
            every rank's pool: docs/parallelism.md), in the rank process; -1: a private pool (GPU ranks).
        expert_parallel_size: ``EngineConfig.expert_parallel_size``: > 1 (then ``world_size``) loads this
            rank's experts and exchanges tokens between the ranks; 1: tensor parallelism.
        moe_exchange: how an expert-parallel rank's MoE layers exchange tokens: ``"shm"``
            (``SharedMemoryDispatcher`` over the region; ``buffer_bytes`` then holds one step's exchange) or
            ``"all_to_all"`` (``AllToAllDispatcher`` over the process group).
    """

    rank: int
    world_size: int
    model_folder: str
    device: str
    dtype: str
    weight_quant: str
    num_threads: int
    page_size: int
    num_pages: int
    store_port: int
    collectives: str
    region_fd: int
    buffer_bytes: int
    logit_widths: tuple[int, ...]
    timeout_s: float
    kv_fd: int = -1
    expert_parallel_size: int = 1
    dp_attention: bool = False
    kv_first_page: int = 0
    kv_region_pages: int = 0
    moe_exchange: str = "all_to_all"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        """Raises ValueError (JSON) or TypeError (fields) on a malformed spec."""
        raw = json.loads(text)
        raw["logit_widths"] = tuple(raw["logit_widths"])
        return cls(**raw)


def connect_store(port: int, world_size: int) -> dist.TCPStore:
    """A client of rank 0's TCP store (ranks 1..N-1). Raises RuntimeError when it cannot connect in time."""
    return dist.TCPStore(STORE_HOST, port, world_size, False, timedelta(seconds=START_TIMEOUT_S))


def make_communicator(spec: RankSpec, group: dist.ProcessGroup | None, region_fd: int) -> Communicator:
    """This rank's communicator for ``spec.collectives`` (``group``: the process group, for ``"torch"``;
    ``region_fd``: this process's descriptor of the region, for ``"shm"``)."""
    if spec.collectives == "shm":
        from engine.parallel.shm import ShmCommunicator

        return ShmCommunicator(region_fd, spec.rank, spec.world_size, spec.buffer_bytes, spec.logit_widths,
                               spec.timeout_s)
    from engine.parallel.torch_comm import TorchCommunicator

    assert group is not None
    return TorchCommunicator(group, torch.device(spec.device), spec.rank, spec.world_size, spec.logit_widths,
                             spec.timeout_s)


def moe_exchange_comm(spec: RankSpec, comm: Communicator) -> ShmCommunicator | None:
    """The communicator an expert-parallel rank's ``SharedMemoryDispatcher`` runs over (``load_model``'s
    ``expert_comm``): ``comm`` when ``spec.moe_exchange`` is ``"shm"`` (rank 0 chooses it only with
    shared-memory collectives), else None (the all-to-all over the process group)."""
    if spec.moe_exchange != "shm":
        return None
    from engine.parallel.shm import ShmCommunicator

    assert isinstance(comm, ShmCommunicator)
    return comm
