#!/usr/bin/env python
"""DP attention against TP attention on the CPU (issue #47 item 5): decode throughput at 32 streams and the KV
pool's capacity in tokens, on the tiny DeepSeek-V3 (``scripts/perf/tiny_moe.py``, fp32).

Three engines of the same model, each rank one torch thread: ``single`` (one rank, every expert), ``tp``
(``expert_parallel_size=2``: attention split by heads over the 2 ranks, each holding the whole latent KV of
every token; experts 4 + 4) and ``dp`` (the same with ``enable_dp_attention``: each rank its own requests and
KV pool, experts 4 + 4). Every pool is sized by ``--kv-mib`` MiB per rank.

1. **Decode throughput**: ``--streams`` requests of ``--prompt-tokens`` tokens (greedy, ignore_eos) are
   prefilled, one decode step runs untimed, then ``--steps`` decode steps are timed back to back:
   tokens/s = streams x steps / their time, and the median step. Rounds (``--rounds``) go in turns over the
   engines; the best round of each counts (damps other processes on a shared host).
2. **KV capacity in tokens**: pages the engine's scheduler can hand out (``LLMEngine.num_total_pages``) x
   page size: one pool's for ``single`` and ``tp`` (under TP both ranks hold the same tokens), N pools' for
   ``dp``.

    PYTHONPATH=.:scripts .venv/bin/python scripts/bench_dp_attention.py

The last line printed is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ENGINES = {"single": {}, "tp": {"expert_parallel_size": 2},
           "dp": {"expert_parallel_size": 2, "enable_dp_attention": True}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--kv-mib", type=int, default=64, help="KV pool bytes per rank, MiB")
    p.add_argument("--page-size", type=int, default=16)
    return p.parse_args()


def decode_round(engine, args: argparse.Namespace, tag: str) -> tuple[float, float]:  # noqa: ANN001
    """(tokens/s, median step ms) of ``args.streams`` streams over ``args.steps`` timed decode steps."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [f"{tag}-{i}" for i in range(args.streams)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [(3 + 37 * i + 11 * t) % vocab for t in range(args.prompt_tokens)], params)
    started: set[str] = set()
    while len(started) < len(ids):   # the prefills (and each stream's first token)
        started.update(o.request_id for o in engine.step())
    engine.step()   # one decode step outside the timing
    times = []
    begin = time.perf_counter()
    for _ in range(args.steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        assert len(outputs) == args.streams, "every stream decodes every step"
    total = time.perf_counter() - begin
    for rid in ids:
        engine.abort_request(rid)
    return args.streams * args.steps / total, statistics.median(times) * 1e3


def main() -> None:
    args = parse_args()
    from perf.tiny_moe import build_tiny_deepseek_v3

    from engine import EngineConfig, LLMEngine

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"host: {os.cpu_count()} CPUs ({cpu}), load average {os.getloadavg()[0]:.2f}; torch "
          f"{torch.__version__}", flush=True)
    report: dict = {"load_average": os.getloadavg()[0], "streams": args.streams, "steps": args.steps,
                    "kv_mib_per_rank": args.kv_mib}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_deepseek_v3(Path(tmp) / "tiny_deepseek_v3")
        engines = {name: LLMEngine(EngineConfig(model=str(folder), page_size=args.page_size,
                                                kv_cache_bytes=args.kv_mib << 20, **kw))
                   for name, kw in ENGINES.items()}
        best: dict[str, tuple[float, float]] = {}
        try:
            for r in range(args.rounds):
                for name, engine in engines.items():
                    torch.set_num_threads(1)
                    tps, ms = decode_round(engine, args, f"{name}{r}")
                    print(f"round {r} {name:6s}: {tps:8.0f} tokens/s, median step {ms:.2f} ms", flush=True)
                    if name not in best or tps > best[name][0]:
                        best[name] = (tps, ms)
            for name, engine in engines.items():
                tokens = engine.num_total_pages * args.page_size
                report[name] = {"tokens_per_s": best[name][0], "median_step_ms": best[name][1],
                                "kv_capacity_tokens": tokens, "pages_per_rank": engine.kv_pool.num_pages}
        finally:
            for engine in engines.values():
                engine.close()
    for name in ENGINES:
        r = report[name]
        print(f"{name:6s}: {r['tokens_per_s']:8.0f} tokens/s at {args.streams} streams (median step "
              f"{r['median_step_ms']:.2f} ms); KV capacity {r['kv_capacity_tokens']:,} tokens "
              f"({r['pages_per_rank']} pages of {args.page_size} per rank)")
    dp, tp = report["dp"], report["tp"]
    print(f"dp / tp: throughput {dp['tokens_per_s'] / tp['tokens_per_s']:.2f}x, KV capacity "
          f"{dp['kv_capacity_tokens'] / tp['kv_capacity_tokens']:.2f}x")
    report["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
