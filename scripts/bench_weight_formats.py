"""The weight-format half of ``bench_engine.py --formats`` (run through it, not alone).

Per format ``dtype:weight_quant``, in a child process of its own (so that peak RSS is that format's):
(a) batch-1 inter-token latency, (b) batch-16 mixed throughput (same workload as ``bench_engine.py``), the
memory-bandwidth limit of (a) = weight bytes one decode step reads / memcpy bandwidth (a 256 MiB tensor copy,
best of 5, bytes copied per second) measured in the same process just before (a), the fraction of that limit
reached (limit / ITL), where a decode step's time goes (the weight products, i.e. every ``linear`` call of
the model, against the rest: attention, norms, RoPE, sampling, the engine's own work) and the fraction of the
limit the products alone reach, peak RSS and perplexity on the first ``--ppl-tokens`` tokens of the shipped
text. The rest does not shrink with the weight bytes, so it caps a format's batch-1 speed-up at
``(products_fp32 + rest) / (products_format + rest)``.
The parent prints one table, the ratios against the first format, the load average, and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch

_TEXT = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 60


def memcpy_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by one ``Tensor.copy_`` of ``nbytes`` (best of ``repeats``, pages touched)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def products_ms_per_step(loaded, prompt: list[int], n: int, **formats: str) -> tuple[float, float]:
    """(ms per batch-1 decode step, ms of it inside the model's weight products), one request of ``n`` new
    tokens after its prefill step; the products are timed by wrapping ``engine.model.llama.linear`` (two clock
    reads per call, ~121 calls per step)."""
    import engine.model.llama as llama
    from engine import EngineConfig, LLMEngine, SamplingParams

    inner, spent = llama.linear, [0.0]

    def timed(x, weight, bias=None):
        start = time.perf_counter()
        try:
            return inner(x, weight, bias)
        finally:
            spent[0] += time.perf_counter() - start

    engine = LLMEngine(EngineConfig(num_pages=64, num_threads=torch.get_num_threads(), **formats), loaded)
    engine.add_request("steps", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token
    llama.linear = timed
    try:
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        llama.linear = inner
    return (time.perf_counter() - start) / steps * 1e3, spent[0] / steps * 1e3


def one_format(args: argparse.Namespace, decode_b1: Callable, mixed: Callable,
               make_prompts: Callable) -> dict:
    """Measure one format in this process; returns the row as a dict."""
    from engine.model import load_model
    from engine.model.perplexity import perplexity, reference_text

    dtype, weight_quant = args.one_format.split(":")
    formats = {"dtype": dtype, "weight_quant": weight_quant}
    loaded = load_model(args.model, dtype=getattr(torch, dtype), weight_quant=weight_quant)
    ids = loaded.tokenizer.encode(_TEXT)
    prompts = make_prompts(ids, args.mixed_requests, args.min_prompt, args.max_prompt, args.seed)
    decode_b1(loaded, ids[:32], 4, **formats)  # warm-up (and the kernels' one-time build)
    bandwidth, b1 = 0.0, 0.0
    for _ in range(args.repeats):
        bandwidth = max(bandwidth, memcpy_bytes_per_s())
        b1 = max(b1, decode_b1(loaded, ids[:32], args.decode_tokens, **formats))
    step_ms, products_ms = min(products_ms_per_step(loaded, ids[:32], args.decode_tokens, **formats)
                               for _ in range(args.repeats))
    b16 = max(mixed(loaded, prompts, args.mixed_new_tokens, args, **formats) for _ in range(args.repeats))
    ppl = perplexity(loaded.model, loaded.tokenizer.encode(reference_text())[:args.ppl_tokens])
    weight_bytes = loaded.model.streamed_weight_bytes()
    limit_ms = weight_bytes / bandwidth * 1e3
    itl_ms = 1e3 / b1
    return {"format": args.one_format, "itl_b1_ms": round(itl_ms, 2), "b16_tok_s": round(b16, 1),
            "weight_mb": round(weight_bytes / 1e6, 1), "memcpy_gb_s": round(bandwidth / 1e9, 2),
            "limit_ms": round(limit_ms, 2), "fraction_of_limit": round(limit_ms / itl_ms, 3),
            "products_ms": round(products_ms, 2), "rest_ms": round(step_ms - products_ms, 2),
            "products_of_limit": round(limit_ms / products_ms, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_end_mb": round(_rss_bytes() / 1e6, 1),
            "perplexity": round(ppl, 4), "load_avg_1m": round(os.getloadavg()[0], 2)}


def run_formats(args: argparse.Namespace, decode_b1: Callable, mixed: Callable,
                make_prompts: Callable) -> None:
    """``--one-format``: measure, print one JSON row. ``--formats``: one child per format, then the table."""
    if args.one_format:
        print(json.dumps(one_format(args, decode_b1, mixed, make_prompts)))
        return
    rows = []
    for fmt in args.formats.split(","):
        child = [sys.executable, sys.argv[0], *_child_args(args), "--one-format", fmt]
        out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    base = rows[0]
    print("\n| format | b1 ITL ms | b1 x | limit ms | of limit | products ms | rest ms | products of limit "
          "| b16 tok/s | b16 x | weights MB "
          f"| peak RSS MB | RSS end MB | perplexity | ppl / base | load |\n|{'---|' * 16}")
    for r in rows:
        r["b1_speedup"] = round(base["itl_b1_ms"] / r["itl_b1_ms"], 2)
        r["b16_speedup"] = round(r["b16_tok_s"] / base["b16_tok_s"], 2)
        r["ppl_ratio"] = round(r["perplexity"] / base["perplexity"], 4)
        print(f"| {r['format']} | {r['itl_b1_ms']} | {r['b1_speedup']} | {r['limit_ms']} | "
              f"{r['fraction_of_limit']:.0%} | {r['products_ms']} | {r['rest_ms']} | "
              f"{r['products_of_limit']:.0%} | {r['b16_tok_s']} | {r['b16_speedup']} | {r['weight_mb']} | "
              f"{r['peak_rss_mb']} | {r['rss_end_mb']} | {r['perplexity']} | {r['ppl_ratio']} | "
              f"{r['load_avg_1m']} |")
    print(f"threads={args.num_threads}, load average at the end {os.getloadavg()}")
    print(json.dumps(rows))


def _rss_bytes() -> int:
    """Resident set size now (peak RSS includes loading, where int8 still holds the float tensors)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child_args(args: argparse.Namespace) -> list[str]:
    names = ("model", "num_threads", "decode_tokens", "mixed_requests", "mixed_new_tokens", "min_prompt",
             "max_prompt",
             "seed", "repeats", "chunk_size", "max_num_batched_tokens", "ppl_tokens")
    return [a for n in names for a in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]
