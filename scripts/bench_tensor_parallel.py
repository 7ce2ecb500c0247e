#!/usr/bin/env python
"""Tensor parallelism on the CPU: decode step time of one engine at TP=1 and TP=2, batch 1 and batch 16.

Engines, all on the same model, dtype and weights, built once and measured in turns (``--repeats`` rounds; the
best round's median counts, which damps other processes on a shared host):

- ``TP=1``: one rank, ``--num-threads`` torch threads (1: the baseline);
- ``TP=2``: two ranks (this process and one rank process), ``--num-threads`` each;
- ``TP=1 x2 threads`` (unless ``--no-threads-line``): one rank with twice the threads, the same cores as TP=2
  given to torch's own intra-op parallelism instead.

A measurement: ``batch`` requests of ``--prompt-tokens`` tokens (greedy, EOS ignored), one prefill step, then
``--steps`` decode steps each timed alone (``engine.step()``, wall clock); the median step is reported. For
TP=2 the rank-0 communicator's counters (``engine.parallel.communicator.CommStats``) say where the
collectives' time goes per step: the all-reduces (60 for SmolLM2: two per layer), of which waiting for the
other rank (its compute arriving later: load imbalance, or a rank descheduled) and the rest copying and
summing; the logits gather; the step broadcast. Last (unless ``--no-slices``), each TP=2 rank's slice of the
model runs alone in this process, no collectives, on the same decode batch: a TP=2 step cannot be shorter than
the slower slice. ``--pin`` pins this process to core 0 and rank r to core r.

    PYTHONPATH=. .venv/bin/python scripts/bench_tensor_parallel.py               # SmolLM2-135M, fp32
    PYTHONPATH=. .venv/bin/python scripts/bench_tensor_parallel.py --dtype bfloat16 --collectives gloo

The last line printed is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from engine import EngineConfig, LLMEngine, SamplingParams


@dataclass
class Setup:
    """One engine under test."""

    name: str
    tensor_parallel_size: int
    num_threads: int
    engine: LLMEngine | None = None
    best_ms: dict[int, float] = field(default_factory=dict)            # batch -> best median step, ms
    collectives_ms: dict[int, dict[str, float]] = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="what engine.model.load_model loads (default: the "
                                                       "bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--weight-quant", default="none")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per measurement")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--collectives", default="auto", choices=("auto", "shm", "gloo"))
    p.add_argument("--pin", action="store_true", help="pin this process to core 0 and rank r to core r")
    p.add_argument("--no-threads-line", action="store_true", help="leave out TP=1 with 2x threads")
    p.add_argument("--no-slices", action="store_true",
                   help="leave out the forward of each TP=2 slice alone (the floor of a TP=2 step)")
    return p.parse_args()


def build(setup: Setup, args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, dtype=args.dtype, weight_quant=args.weight_quant, num_pages=512,
                          num_threads=setup.num_threads, tensor_parallel_size=setup.tensor_parallel_size,
                          tp_collectives=args.collectives)
    setup.engine = LLMEngine(config)
    if args.pin and setup.engine.parallel is not None:
        for rank, pid in enumerate(setup.engine.parallel.rank_pids, start=1):
            os.sched_setaffinity(pid, {rank % os.cpu_count()})


def measure(setup: Setup, batch: int, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    """Median decode step (ms) of ``batch`` requests, and the collectives' ms per step (TP > 1)."""
    engine = setup.engine
    assert engine is not None
    torch.set_num_threads(setup.num_threads)   # process-wide: each engine set its own at start
    if args.pin:
        os.sched_setaffinity(0, {0} if setup.num_threads == 1 else set(range(setup.num_threads)))
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(1000 + 37 * i + 11 * t) % vocab for t in range(args.prompt_tokens)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    engine.step()   # the prefill (every prompt fits one step) and the first tokens
    engine.step()   # one decode step outside the timing
    comm = engine.parallel.comm if engine.parallel is not None else None
    by_place = [0.0, 0.0]   # rank 0's all-reduce waits after the attention (o_proj) and after the MLP (down)
    if comm is not None:
        comm.stats.reset()
        comm.all_reduce = _split_waits(comm, by_place)   # type: ignore[method-assign]
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    per_step: dict[str, float] = {}
    if comm is not None:
        del comm.all_reduce   # the class's own again
        per_step["wait_after_attention_ms"] = by_place[0] / args.steps * 1e3
        per_step["wait_after_mlp_ms"] = by_place[1] / args.steps * 1e3
        for name, op in comm.stats.ops.items():
            per_step[f"{name}_ms"] = op.seconds / args.steps * 1e3
            per_step[f"{name}_wait_ms"] = op.wait_seconds / args.steps * 1e3
            per_step[f"{name}_calls"] = op.calls / args.steps
    return statistics.median(times) * 1e3, per_step


def _split_waits(comm, by_place: list[float]):  # noqa: ANN001, ANN202 - a benchmark's wrapper
    """``comm.all_reduce`` that also adds each call's waiting to ``by_place[0]`` (the layer's first
    all-reduce, after the attention) or ``by_place[1]`` (its second, after the MLP): a layer makes two."""
    original, calls = comm.all_reduce, [0]

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        before = comm.stats.op("all_reduce").wait_seconds
        out = original(x)
        by_place[calls[0] % 2] += comm.stats.op("all_reduce").wait_seconds - before
        calls[0] += 1
        return out

    return all_reduce


def slices_alone(args: argparse.Namespace, batches: list[int]) -> dict[int, list[float]]:
    """Median forward (ms) of each TP=2 rank's slice run alone in this process (no collectives), per batch: a
    decode step of ``batch`` sequences at position 40. A TP=2 step cannot take less than the slower one."""
    from engine.forward_batch import ForwardBatch
    from engine.kv_pool import KVPool, KVShape
    from engine.model import load_model
    from engine.model.loader import resolve_model_folder

    torch.set_num_threads(args.num_threads)
    folder, out = str(resolve_model_folder(args.model)), {b: [] for b in batches}
    for rank in range(2):
        loaded = load_model(folder, dtype=getattr(torch, args.dtype), weight_quant=args.weight_quant,
                            rank=rank, tensor_parallel_size=2)
        mc, shard = loaded.config, loaded.model.shard
        pool = KVPool(KVShape(mc.num_layers, shard.num_kv_heads, mc.head_dim, 16), 4 * max(batches),
                      getattr(torch, args.dtype), "cpu")
        for batch in batches:
            tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(batch)]
            step = ForwardBatch(torch.full((batch,), 5), torch.full((batch,), 40),
                                torch.tensor([t[2] * 16 + 8 for t in tables]), [1] * batch, [41] * batch,
                                tables, torch.arange(batch))
            times = []
            for i in range(args.steps + 2):
                start = time.perf_counter()
                loaded.model.forward(step, pool.kv_cache)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            out[batch].append(statistics.median(times) * 1e3)
    return out


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    setups = [Setup("TP=1", 1, args.num_threads), Setup("TP=2", 2, args.num_threads)]
    if not args.no_threads_line:
        setups.append(Setup(f"TP=1 x{2 * args.num_threads} threads", 1, 2 * args.num_threads))
    for setup in setups:
        build(setup, args)
    weights = {s.name: (s.engine.parallel.loaded if s.engine.parallel else s.engine.runner).model
               .streamed_weight_bytes() for s in setups}
    try:
        for _ in range(args.repeats):
            for batch in batches:
                for setup in setups:
                    ms, coll = measure(setup, batch, args)
                    if ms < setup.best_ms.get(batch, float("inf")):
                        setup.best_ms[batch], setup.collectives_ms[batch] = ms, coll
    finally:
        for setup in setups:
            if setup.engine is not None:
                setup.engine.close()
    report(setups, batches, weights, args, {} if args.no_slices else slices_alone(args, batches))


def report(setups: list[Setup], batches: list[int], weights: dict[str, int], args: argparse.Namespace,
           slices: dict[int, list[float]]) -> None:
    base = setups[0]
    print(f"model {args.model}, {args.dtype}/{args.weight_quant}, {args.num_threads} thread(s) per rank, "
          f"collectives {args.collectives}, pinned {args.pin}; best of {args.repeats} rounds of the median "
          f"of {args.steps} steps")
    for batch in batches:
        for setup in setups:
            ms = setup.best_ms[batch]
            print(f"batch {batch:>2} {setup.name:<16} {ms:7.1f} ms/step  "
                  f"{base.best_ms[batch] / ms:5.2f}x TP=1  "
                  f"(rank 0 streams {weights[setup.name] / 1e6:.0f} MB of weights per step)")
            coll = setup.collectives_ms.get(batch)
            if coll and args.collectives == "gloo":   # gloo's waits are inside its calls: not separated
                print("         collectives per step on rank 0: " + ", ".join(
                    f"{op} {coll[op + '_calls']:.0f} calls {coll[op + '_ms']:.2f} ms"
                    for op in ("all_reduce", "gather_logits", "broadcast_step") if op + "_ms" in coll))
            elif coll:
                print("         collectives per step on rank 0: " + ", ".join(
                    f"{op} {coll[op + '_calls']:.0f} calls {coll[op + '_ms']:.2f} ms "
                    f"(waiting {coll[op + '_wait_ms']:.2f})"
                    for op in ("all_reduce", "gather_logits", "broadcast_step") if op + "_ms" in coll))
                attention, mlp = coll["wait_after_attention_ms"], coll["wait_after_mlp_ms"]
                print(f"         all-reduce waiting after the attention {attention:.2f} ms, after the MLP "
                      f"{mlp:.2f} ms")
    for batch, (rank0, rank1) in slices.items():
        print(f"batch {batch:>2} each TP=2 slice alone (no collectives): rank 0 {rank0:.1f} ms, rank 1 "
              f"{rank1:.1f} ms")
    load = os.getloadavg()[0]
    print(f"load average at the end {load:.1f}")
    print(json.dumps({"model": args.model, "dtype": args.dtype, "weight_quant": args.weight_quant,
                      "num_threads": args.num_threads, "collectives": args.collectives, "pinned": args.pin,
                      "load_average": round(load, 2),
                      "slices_alone_ms": {str(b): [round(v, 2) for v in ms] for b, ms in slices.items()},
                      "step_ms": {s.name: {str(b): round(s.best_ms[b], 2) for b in batches} for s in setups},
                      "ratio_vs_tp1": {s.name: {str(b): round(base.best_ms[b] / s.best_ms[b], 3)
                                                for b in batches} for s in setups},
                      "collectives_ms_per_step": {s.name: {str(b): {k: round(v, 3) for k, v in c.items()}
                                                           for b, c in s.collectives_ms.items()}
                                                  for s in setups if s.collectives_ms.get(batches[0])}}))


if __name__ == "__main__":
    main()
