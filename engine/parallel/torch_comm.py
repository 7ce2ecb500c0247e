"""``TorchCommunicator``: the collectives over a ``torch.distributed`` process group, and the group's set-up.

The group is built from the instance's TCP store without ``init_process_group``'s global default group, so
several engines (of one process, e.g. a test's) each keep their own: gloo (``ProcessGroupGloo``) for CPU
ranks, NCCL (``ProcessGroupNCCL``, one rank per device) for CUDA ranks. On the CPU the per-step collectives go
through ``engine.parallel.shm`` instead (a gloo all-reduce of one decode row took 1.2-2.5 ms on this project's
2-core hosts); gloo stays the group's rendezvous and the fallback where ``shm_sync.c`` cannot be built
(``EngineConfig.tp_collectives``). The NCCL path is written behind the same seam and has not run here (no GPU
on the hosts this project is tested on).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.communicator import CollectiveError, Communicator, transport_reason

#: the process group's own timeout once joined: long, so that an idle rank waiting for its next step is not
#: timed out by the backend; each call bounds its own wait with ``Communicator.timeout_s`` instead. Joining
#: is bounded by ``JOIN_TIMEOUT``: a rank that died before connecting fails the join instead of hanging it.
_GROUP_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT = timedelta(seconds=120)
_FROM_RANK_0 = dist.BroadcastOptions()
_FROM_RANK_0.rootRank = 0


def open_process_group(store: dist.Store, rank: int, world_size: int,
                       device: torch.device) -> dist.ProcessGroup:
    """Join the ranks' process group through ``store`` (every rank calls it; it returns once all joined).

    Args:
        store: the instance's TCP store (keys under ``pg/``).
        rank, world_size: this rank of the group.
        device: the rank's torch device: NCCL for CUDA, gloo otherwise.
    Raises:
        RuntimeError: the other ranks did not join within ``JOIN_TIMEOUT``, or the backend is missing.
    """
    prefixed = dist.PrefixStore("pg/", store)
    # torch's stubs derive ProcessGroupNCCL/Gloo from Backend, which they give none of the collectives this
    # module calls; at run time both groups have them, as ProcessGroup does
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)  # type: ignore[return-value]
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, JOIN_TIMEOUT)
    group.set_timeout(_GROUP_TIMEOUT)
    return group  # type: ignore[return-value]


class TorchCommunicator(Communicator):
    """Collectives through ``group`` (gloo or NCCL); tensors are moved to ``device`` for NCCL.

    Args:
        group: the ranks' process group (``open_process_group``).
        device: where this rank's tensors live.
        rank, world_size, logit_widths, timeout_s: as ``Communicator``.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, rank: int, world_size: int,
                 logit_widths: tuple[int, ...], timeout_s: float) -> None:
        super().__init__(rank, world_size, logit_widths, timeout_s)
        self._group = group
        self._device = device
        self._timeout = timedelta(seconds=timeout_s)
        self._aborted = ""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with self._timed("all_reduce", x.numel() * x.element_size()):
            self._wait("all_reduce", self._group.allreduce([x]))
        return x

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        rows, width = logits.shape[0], max(self.logit_widths)
        padded = torch.zeros(rows, width, dtype=torch.float32, device=logits.device)
        padded[:, :logits.shape[1]] = logits
        outs = [torch.empty_like(padded) for _ in range(self.world_size)]
        with self._timed("gather_logits", logits.numel() * 4):
            self._wait("gather_logits", self._group.allgather([outs], [padded]))
        if self.rank != 0:
            return logits
        return torch.cat([o[:, :w] for o, w in zip(outs, self.logit_widths)], dim=1)

    def broadcast_step(self, payload: torch.Tensor | None, wait_forever: bool = False) -> torch.Tensor:
        count = 0 if payload is None else payload.numel()
        size = torch.tensor([count], dtype=torch.int64, device=self._device)
        with self._timed("broadcast_step", 0 if payload is None else payload.numel() * 8):
            self._wait("broadcast_step", self._group.broadcast([size], _FROM_RANK_0), forever=wait_forever)
            data = payload.to(self._device) if payload is not None else \
                torch.empty(int(size.item()), dtype=torch.int64, device=self._device)
            self._wait("broadcast_step", self._group.broadcast([data], _FROM_RANK_0))
        return data.cpu()

    def abort(self, reason: str) -> None:
        self._aborted = self._aborted or reason
        try:
            self._group.abort()
        except (RuntimeError, AttributeError):   # a backend without abort: its pending calls time out
            pass

    def close(self) -> None:
        try:
            self._group.shutdown()
        except (RuntimeError, AttributeError):
            pass

    def _wait(self, op: str, work: dist.Work, forever: bool = False) -> None:
        if self._aborted:
            raise CollectiveError(op, f"the group was aborted: {self._aborted}")
        try:
            work.wait() if forever else work.wait(self._timeout)
        except RuntimeError as e:
            raise CollectiveError(op, self._aborted or transport_reason(e)) from None
