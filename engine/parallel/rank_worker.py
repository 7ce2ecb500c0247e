"""``python -m engine.parallel.rank_worker --spec JSON``: one tensor-parallel rank (1..N-1) of an engine.

Rank 0 (the engine's own process, ``engine.parallel.group``) starts it. Lifecycle:

1. watch the parent: stdin is a pipe whose only write end rank 0 holds; end-of-file (rank 0 died in any way,
   or stopped) ends this process at once (``os._exit``), so a rank never outlives its instance;
2. join: connect rank 0's TCP store, say hello (``hello/<rank>``), join the process group;
3. load this rank's slice of the model and its slice of the KV pool (``num_pages`` pages, the same ids as
   rank 0's; only its KV heads), build the communicator, say ready (``ready/<rank>``);
4. serve: wait for each step's message (no timeout while idle), run the shard's forward (its all-reduces and
   the logits gather meet rank 0's), until a ``STOP`` message: exit 0;
5. on any error: abort the group with the reason (rank 0's waits end at once, naming it), exit 1.

Logs go to stderr (the engine process's, i.e. the server log).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import torch

from engine.model.moe_dispatch import DispatchError
from engine.parallel.communicator import CollectiveError, Communicator
from engine.parallel.spec import RankSpec, connect_store, make_communicator, moe_exchange_comm
from engine.parallel.step import DP_STEP, STOP, decode_dp_step, decode_step, message_op

logger = logging.getLogger("engine.parallel.rank_worker")


def watch_parent(fd: int) -> threading.Thread:
    """Start a daemon thread that reads the descriptor ``fd`` (the parent's pipe) until end-of-file, then
    ends this process with status 3. Returns the thread. (``os.read`` on the descriptor, not ``sys.stdin``: a
    daemon thread blocked inside a buffered reader's lock aborts the interpreter's shutdown.)"""
    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        finally:
            os._exit(3)

    thread = threading.Thread(target=watch, name="tp-parent-watch", daemon=True)
    thread.start()
    return thread


def serve(comm: Communicator, model: torch.nn.Module, kv_cache: torch.Tensor,
          device: torch.device) -> tuple[int, float]:
    """Run the shard's forward for every step message until ``STOP`` (a ``DP_STEP``: this rank's own batch
    of it, possibly empty); returns the steps run and the seconds spent in their forwards (collectives
    included).

    Raises:
        CollectiveError, DispatchError: a collective or an MoE exchange failed (rank 0 aborted the group,
            a rank went silent or died).
        ValueError: a malformed message.
    """
    steps, busy_s = 0, 0.0
    while True:
        message = comm.broadcast_step(None, wait_forever=True)
        op = message_op(message)
        if op == STOP:
            return steps, busy_s
        start = time.perf_counter()
        batch = decode_dp_step(message, comm.rank, device) if op == DP_STEP else decode_step(message, device)
        model.forward(batch, kv_cache)
        busy_s += time.perf_counter() - start
        steps += 1


def run(spec: RankSpec) -> int:
    """Join, load, serve (the lifecycle above); returns the exit status."""
    from engine.kv_pool import KVPool, KVShape
    from engine.model import load_model
    from engine.parallel.torch_comm import open_process_group

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    store = connect_store(spec.store_port, spec.world_size)
    store.set(f"hello/{spec.rank}", str(os.getpid()))
    group = open_process_group(store, spec.rank, spec.world_size, device)
    comm = make_communicator(spec, group, spec.region_fd)
    if spec.expert_parallel_size > 1:   # an MoE model: this rank's experts, tokens over the group
        loaded = load_model(spec.model_folder, dtype=getattr(torch, spec.dtype), device=device,
                            weight_quant=spec.weight_quant, expert_group=group,
                            expert_timeout_s=spec.timeout_s, dp_attention=spec.dp_attention,
                            expert_comm=moe_exchange_comm(spec, comm))
    else:
        loaded = load_model(spec.model_folder, dtype=getattr(torch, spec.dtype), device=device,
                            weight_quant=spec.weight_quant, rank=spec.rank,
                            tensor_parallel_size=spec.world_size, dp_attention=spec.dp_attention)
    shard, mc = loaded.model.shard, loaded.config
    pool = KVPool(KVShape(mc.num_layers, shard.num_kv_heads, mc.head_dim, spec.page_size, mc.kv_layout_kind),
                  spec.num_pages, getattr(torch, spec.dtype), device, shared_fd=spec.kv_fd,
                  fd_first_page=spec.kv_first_page, fd_num_pages=spec.kv_region_pages or None)
    loaded.model.attach(comm)
    store.set(f"ready/{spec.rank}", "1")
    logger.info("rank %d/%d ready (pid %d): heads %s, KV heads [%d, %d), %d pages", spec.rank,
                spec.world_size, os.getpid(), shard.heads, shard.kv_heads.start, shard.kv_heads.stop,
                spec.num_pages)
    try:
        steps, busy_s = serve(comm, loaded.model, pool.kv_cache, device)
    except (CollectiveError, DispatchError) as e:
        logger.error("rank %d stops: %s", spec.rank, e)
        return 1
    except Exception as e:
        logger.exception("rank %d failed inside a step", spec.rank)
        comm.abort(f"rank {spec.rank} (pid {os.getpid()}) failed: {e!r}")
        return 1
    waits = {name: op.wait_seconds for name, op in comm.stats.ops.items()}
    logger.info("rank %d stopped after %d steps: forwards %.1f s, of which waiting for the other ranks %s",
                spec.rank, steps, busy_s, {k: round(v, 3) for k, v in waits.items()})
    comm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of an engine (started by rank 0)")
    parser.add_argument("--spec", required=True, help="the RankSpec as JSON")
    spec = RankSpec.from_json(parser.parse_args(argv).spec)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    watch_parent(sys.stdin.fileno())
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
