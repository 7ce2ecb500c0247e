"""The weight products of one decode step on this CPU, per path and row count (a benchmark, not a test).

Which path should multiply a decode step's activations ``x`` ``[M, K]`` by the weights? For each ``M`` of
``--rows`` this times every weight product of one SmolLM2-135M decode step (per layer the fused ``qkv``
960x576, ``o`` 576x576, fused ``gate_up`` 3072x576, ``down`` 576x1536, 30 layers, then the LM head 49152x576:
the 121 products of ``engine.model.llama``; 134.5 M weights, more than most CPUs' caches, so each step streams
them from memory; not on a CPU with 300 MB of L3, which holds the bf16 set) through each path available here:

- ``fp32``: ``F.linear`` in float32 (oneDNN/MKL); the baseline.
- ``bf16 torch``: ``F.linear`` in bfloat16 (oneDNN: AMX tiles where the CPU has AMX, AVX512_BF16 else).
- ``bf16 packed for 1`` / ``for 16``: oneDNN's prepacked bf16 weight
  (``torch.ops.mkldnn._reorder_linear_weight`` once, for a batch of 1 or of 16 rows, then
  ``torch.ops.mkldnn._linear_pointwise``), the layout torch's own CPU inference passes use; the engine packs
  for 16 rows (``engine.model.linear.PackedBF16Weight``).
- ``bf16 kernel``, ``bf16 kernel fp32-x``, ``int8 kernel``: the engine's kernels (``engine/model/kernels``).
- ``int8 torch``: ``aten._weight_int8pack_mm`` (int8 weights per output channel, bfloat16 activations).

Weights are random (seeded): a product's time does not depend on its values. Each path runs ``--repeats``
steps after one warm-up; the best step is kept. Printed per thread count: ms per step, the ratio to fp32 at
the same ``M``, the memory-bandwidth limit (weight bytes / a 256 MiB ``copy_``'s rate, measured just before),
and whether the path is batch-invariant (every row of an ``M``-row product of decode-like rows equals, bit for
bit, the same row multiplied alone, copied to a buffer of its own and, for the packed paths, padded to two
rows as ``engine.model.linear.PackedBF16Weight`` does; the engine's decode kernels promise that:
docs/benchmarks.md "Weight formats"). The CPU's model and AMX/AVX-512 flags come first. Run: ``python
scripts/bench_cpu_products.py --threads 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_weight_formats import memcpy_bytes_per_s  # noqa: E402 (this folder, as a script)

from engine.model.kernels import gemv_kernels  # noqa: E402
from engine.model.linear import Int8Weight, weight_bytes  # noqa: E402

#: SmolLM2-135M's product shapes (N, K) in one decode step, in order (config.json of the model).
LAYERS, HIDDEN, INTER, QKV = 30, 576, 1536, 960
VOCAB = 49152
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]

Product = Callable[[torch.Tensor], torch.Tensor]


def cpu_facts() -> dict[str, object]:
    """The CPU's model name, its AMX / AVX-512 flags (``/proc/cpuinfo``), torch's capability, core count."""
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "amx_tile": torch.cpu._is_amx_tile_supported(),
            "flags": sorted(f for f in flags if f.startswith(("amx", "avx512")))}


def build_paths(m: int, gen: torch.Generator) -> dict[str, tuple[list[Product], int, torch.dtype]]:
    """name -> (one product per shape, weight bytes per step, activation dtype) for ``m`` rows."""
    fp32 = [torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES]
    bf16 = [w.bfloat16() for w in fp32]
    int8 = [Int8Weight.quantize(w) for w in fp32]  # the engine's weight-only int8 (per output row)
    int8_bytes = sum(weight_bytes(q) for q in int8)
    nbytes = sum(n * k for n, k in SHAPES)
    paths: dict[str, tuple[list[Product], int, torch.dtype]] = {
        "fp32": ([lambda x, w=w: F.linear(x, w) for w in fp32], 4 * nbytes, torch.float32),
        "bf16 torch": ([lambda x, w=w: F.linear(x, w) for w in bf16], 2 * nbytes, torch.bfloat16),
    }
    for name, hint in (("bf16 packed for 1", 1), ("bf16 packed for 16", 16)):
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in bf16]
        except RuntimeError as exc:
            print(f"{name}: unavailable ({exc})".splitlines()[0], flush=True)
            break
        paths[name] = ([lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                        for w in packed], 2 * nbytes, torch.bfloat16)
    kernels = gemv_kernels()
    if kernels is not None:
        if kernels.native_bf16:
            paths["bf16 kernel"] = ([lambda x, w=w: kernels.bf16_native(x, w) for w in bf16], 2 * nbytes,
                                    torch.bfloat16)
        paths["bf16 kernel fp32-x"] = ([lambda x, w=w: kernels.bf16(x, w) for w in bf16], 2 * nbytes,
                                       torch.float32)
        paths["int8 kernel"] = ([lambda x, q=q: kernels.int8(x, q.qweight, q.scale) for q in int8],
                                int8_bytes, torch.float32)
    paths["int8 torch"] = ([lambda x, q=q: q.int8pack_mm(x) for q in int8], int8_bytes, torch.bfloat16)
    return paths


def time_step(products: list[Product], xs: dict[int, torch.Tensor], repeats: int) -> float:
    """Best seconds for one pass over every product (each with the activation of its ``K``)."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        for (_, k), product in zip(SHAPES, products):
            product(xs[k])
        if i:  # the first pass warms up (oneDNN's kernel selection, page faults)
            best = min(best, time.perf_counter() - start)
    return best


def batch_invariant(products: list[Product], xs: dict[int, torch.Tensor], pad_single_row: bool) -> bool:
    """True when every row of each product equals that row multiplied alone, bit for bit (a sample of
    products: the first layer's four and the LM head), on rows like a decode step's (``silu(a) * b``,
    heavy-tailed: Gaussian rows hide most differences in the bf16 rounding); ``pad_single_row`` multiplies a
    row alone padded to two rows, as ``PackedBF16Weight`` does."""
    m = next(iter(xs.values())).shape[0]
    if m == 1:
        return True
    gen = torch.Generator().manual_seed(1)
    for (_, k), product in list(zip(SHAPES, products))[:4] + [(SHAPES[-1], products[-1])]:
        x = (F.silu(torch.randn(m, k, generator=gen)) * torch.randn(m, k, generator=gen)).to(xs[k].dtype)
        whole = product(x)
        for row in range(m):
            alone = x[row:row + 1].clone()
            alone = torch.cat([alone, torch.zeros_like(alone)]) if pad_single_row else alone
            if not torch.equal(whole[row], product(alone)[0]):
                return False
    return True


def run(threads: int, rows: list[int], repeats: int, seed: int) -> list[dict[str, object]]:
    torch.set_num_threads(threads)
    out = []
    for m in rows:
        gen = torch.Generator().manual_seed(seed)
        paths = build_paths(m, gen)
        bandwidth = memcpy_bytes_per_s()
        base_ms = None
        for name, (products, nbytes, dtype) in paths.items():
            xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in SHAPES}}
            ms = time_step(products, xs, repeats) * 1e3
            base_ms = ms if name == "fp32" else base_ms
            row = {"threads": threads, "rows": m, "path": name, "ms_per_step": round(ms, 2),
                   "vs_fp32": round(base_ms / ms, 2), "weight_mb": round(nbytes / 1e6, 1),
                   "limit_ms": round(nbytes / bandwidth * 1e3, 2),
                   "of_limit": round(nbytes / bandwidth * 1e3 / ms, 3),
                   "memcpy_gb_s": round(bandwidth / 1e9, 2),
                   "batch_invariant": batch_invariant(products, xs, name.startswith("bf16 packed"))}
            print(json.dumps(row), flush=True)
            out.append(row)
        del paths
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    p.add_argument("--rows", default="1,4,16", help="comma-separated row counts M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(cpu_facts()), flush=True)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        rows += run(threads, [int(m) for m in args.rows.split(",")], args.repeats, args.seed)
    print("\n| threads | M | path | ms/step | vs fp32 | limit ms | of limit | batch-invariant |\n|"
          + "---|" * 8)
    for r in rows:
        print(f"| {r['threads']} | {r['rows']} | {r['path']} | {r['ms_per_step']} | {r['vs_fp32']} | "
              f"{r['limit_ms']} | {r['of_limit']:.0%} | {'yes' if r['batch_invariant'] else 'no'} |")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
