"""The collectives seam of a tensor-parallel instance: what a rank's model and the step broadcast call.

Contract
- One ``Communicator`` per rank process, built by the rank group (``engine.parallel.group`` on rank 0,
  ``engine.parallel.rank_worker`` on the others) once every rank joined; only that rank's engine thread calls
  it (rank 0: the engine loop thread; others: the process's main thread). Not thread-safe.
- Every rank makes the same calls in the same order (the step broadcast, then the model's all-reduces, then
  the logits gather); a rank that skips one desynchronises the group, so any error inside a step ends it.
- Every call returns, or raises ``CollectiveError`` within the group's timeout (``timeout_s``) or at once when
  the group was aborted (``abort``: rank 0 does it when a rank process exits); it never hangs.
- Implementations: ``engine.parallel.shm.ShmCommunicator`` (CPU ranks of one host: a shared memfd and
  futex-backed flags) and ``engine.parallel.torch_comm.TorchCommunicator`` (a ``torch.distributed`` process
  group: gloo on the CPU, NCCL on GPUs).
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


class CollectiveError(RuntimeError):
    """A collective did not complete: the group was aborted, a peer timed out or its connection broke.

    Attributes:
        op: the collective (``"all_reduce"``, ``"gather_logits"``, ``"broadcast_step"``).
        reason: what happened.
    """

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"{op}: {reason}")
        self.op = op
        self.reason = reason


def transport_reason(error: Exception) -> str:
    """The words of a collective's error that say what happened, for the requests it fails: its first line
    without the source location gloo puts first and the advice it appends (``"[/.../pair.cc:537] Read error
    [127.0.0.1]:27572: Connection reset by peer. This may indicate ..."`` ->
    ``"Read error [127.0.0.1]:27572: Connection reset by peer"``)."""
    first = (str(error).splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)
    return first.split(". ")[0].rstrip(".") or type(error).__name__


@dataclass
class OpStats:
    """Counters of one kind of collective on this rank.

    Attributes:
        calls: calls made.
        seconds: wall time inside the calls (copies, waits, sums).
        wait_seconds: the part of ``seconds`` spent waiting for other ranks (skew, their compute).
        bytes: bytes this rank contributed.
    """

    calls: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    bytes: int = 0


@dataclass
class CommStats:
    """Per-collective counters of one rank (``Communicator.stats``), e.g. to say where a step's time goes."""

    ops: dict[str, OpStats] = field(default_factory=dict)

    def op(self, name: str) -> OpStats:
        return self.ops.setdefault(name, OpStats())

    def reset(self) -> None:
        self.ops.clear()


class Communicator(ABC):
    """The collectives of one rank of ``world_size``.

    Args:
        rank, world_size: this rank and the group's size.
        logit_widths: vocabulary columns each rank's LM head holds, in rank order
            (``len(shard_for(cfg, r, world_size).vocab)``).
        timeout_s: how long a call may wait for the other ranks before it raises ``CollectiveError``.
    """

    def __init__(self, rank: int, world_size: int, logit_widths: tuple[int, ...], timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.logit_widths = logit_widths
        self.timeout_s = timeout_s
        self.stats = CommStats()

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same values (summed in rank order).

        Args:
            x: ``[..]`` contiguous, the model dtype (fp32, bf16, fp16), same shape on every rank.
        Returns:
            ``x``, now holding the sum.
        Raises:
            CollectiveError: as in the module contract.
        """

    @abstractmethod
    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets every rank's vocabulary columns side by side.

        Args:
            logits: ``[rows, logit_widths[rank]]`` float32, contiguous; ``rows`` equal on every rank.
        Returns:
            On rank 0 ``[rows, sum(logit_widths)]`` float32 (rank 0's columns first); elsewhere ``logits``.
        Raises:
            CollectiveError: as in the module contract.
        """

    @abstractmethod
    def broadcast_step(self, payload: torch.Tensor | None, wait_forever: bool = False) -> torch.Tensor:
        """Rank 0 sends one step's message to every rank.

        Args:
            payload: rank 0: ``[n]`` int64 (``engine.parallel.step.encode_step``); elsewhere None.
            wait_forever: a receiving rank waits with no timeout (an idle engine sends no step for as long as
                it likes); aborts still end the wait.
        Returns:
            The payload, ``[n]`` int64 on the CPU (a copy on the receiving ranks).
        Raises:
            CollectiveError: as in the module contract.
        """

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Make every pending and later call on every rank of this host fail at once with ``reason`` (any
        thread: rank 0's rank watch calls it when a rank process exits)."""

    @abstractmethod
    def close(self) -> None:
        """Release this rank's resources (mappings, process group); later calls are undefined."""

    def _timed(self, name: str, nbytes: int) -> OpTimer:
        return OpTimer(self.stats.op(name), nbytes)


class OpTimer:
    """Adds one call's time and bytes to an ``OpStats`` (``with comm._timed(...) as t: ...; t.waited(s)``)."""

    def __init__(self, stats: OpStats, nbytes: int) -> None:
        self._stats = stats
        self._nbytes = nbytes
        self._start = 0.0

    def __enter__(self) -> OpTimer:
        self._start = time.perf_counter()
        return self

    def waited(self, seconds: float) -> None:
        self._stats.wait_seconds += seconds

    def __exit__(self, *exc: object) -> None:
        self._stats.calls += 1
        self._stats.bytes += self._nbytes
        self._stats.seconds += time.perf_counter() - self._start
