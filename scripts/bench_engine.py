"""Engine vs transformers on the same weights, threads and workloads (a benchmark, not a test).

(a) batch-1 decode: tokens/s of the decode phase alone (prefill excluded on both sides).
(b) mixed batch: 16 prompts of 16..512 tokens x 64 new tokens, total output tokens/s over the whole run
    (prefill included); transformers runs one batched ``generate`` with left padding.

Usage: ``python scripts/bench_engine.py [--num-threads 1]``. The last line printed is a JSON object with
``decode_b1_tok_s``, ``decode_b1_hf_tok_s``, ``decode_b1_ratio``, ``mixed_tok_s``, ``mixed_hf_tok_s``,
``mixed_ratio``, ``peak_rss_mb``.

``--formats float32:none,bfloat16:none,float32:int8`` instead compares the engine's weight formats
(``dtype:weight_quant``; no transformers): each in its own process (its own peak RSS), giving (a) and (b)
plus the memory-bandwidth limit of (a) (weight bytes per step / memcpy bandwidth measured in the same
process), the fraction of it reached, and perplexity on the shipped public-domain text
(``engine.model.perplexity``); ratios against the first format. See ``bench_weight_formats.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2",
                   help="what engine.model.load_model loads: 'smollm2' (the bundled GGUF) or a model folder, "
                        "e.g. one of scripts/perf/tiny_model.py's random models")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=64, help="(a) new tokens at batch 1")
    p.add_argument("--mixed-requests", type=int, default=16)
    p.add_argument("--mixed-new-tokens", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2,
                   help="engine and transformers runs alternate this many times; the best of each is kept "
                        "(damps noise from other processes on a shared machine)")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--formats", default="",
                   help="compare weight formats, e.g. float32:none,bfloat16:none,float32:int8 "
                        "(dtype:weight_quant; the first is the baseline)")
    p.add_argument("--one-format", default="", help=argparse.SUPPRESS)  # a child process of --formats
    p.add_argument("--ppl-tokens", type=int, default=512, help="tokens of the perplexity text (--formats)")
    return p.parse_args()


def make_prompts(vocab_ids: list[int], n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts with lengths spread evenly over [lo, hi] (shuffled), cut from real text token ids."""
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    return [vocab_ids[i:i + k] for i, k in enumerate(lengths)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def engine_decode_b1(loaded, prompt: list[int], n: int, **formats: str) -> float:
    """Decode tokens/s at batch 1, timed from the first token to the last (``formats``: ``dtype``,
    ``weight_quant`` of ``loaded``)."""
    engine = LLMEngine(EngineConfig(num_pages=64, num_threads=torch.get_num_threads(), **formats), loaded)
    engine.add_request("b1", prompt, greedy(n))
    engine.step()  # prefill + first token
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def engine_mixed(loaded, prompts: list[list[int]], n: int, args: argparse.Namespace, **formats: str) -> float:
    """Output tokens/s over a whole continuous-batching run of ``prompts``."""
    cfg = EngineConfig(num_pages=1024, chunk_size=args.chunk_size, num_threads=args.num_threads,
                       max_num_batched_tokens=args.max_num_batched_tokens, **formats)
    engine = LLMEngine(cfg, loaded)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"m{i}", p, greedy(n))
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def hf_generate_s(hf, prompts: list[list[int]], n: int, pad_id: int) -> float:
    """Seconds for one transformers greedy ``generate`` of ``n`` new tokens over left-padded ``prompts``."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad_id)
    assert out.shape[1] == width + n
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    if args.formats or args.one_format:
        from bench_weight_formats import run_formats

        run_formats(args, engine_decode_b1, engine_mixed, make_prompts)
        return
    from transformers import AutoModelForCausalLM

    from engine.model import load_model

    loaded = load_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # same as ignore_eos: always n new tokens
    text = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 60
    ids = loaded.tokenizer.encode(text)
    pad_id = loaded.config.eos_token_ids[0]
    b1_prompt = ids[:32]
    mixed = make_prompts(ids, args.mixed_requests, args.min_prompt, args.max_prompt, args.seed)

    engine_decode_b1(loaded, b1_prompt, 4)  # warm-up
    hf_generate_s(hf, [b1_prompt], 4, pad_id)
    b1, hf_b1, mixed_tok_s, hf_mixed = 0.0, 0.0, 0.0, 0.0
    for _ in range(args.repeats):
        b1 = max(b1, engine_decode_b1(loaded, b1_prompt, args.decode_tokens))
        hf_first = hf_generate_s(hf, [b1_prompt], 1, pad_id)
        hf_all = hf_generate_s(hf, [b1_prompt], args.decode_tokens, pad_id)
        hf_b1 = max(hf_b1, (args.decode_tokens - 1) / (hf_all - hf_first))
    print(f"(a) batch-1 decode: engine {b1:.1f} tok/s, transformers {hf_b1:.1f} tok/s")
    total = len(mixed) * args.mixed_new_tokens
    for _ in range(args.repeats):
        mixed_tok_s = max(mixed_tok_s, engine_mixed(loaded, mixed, args.mixed_new_tokens, args))
        hf_mixed = max(hf_mixed, total / hf_generate_s(hf, mixed, args.mixed_new_tokens, pad_id))
    print(f"(b) mixed {len(mixed)} x {args.mixed_new_tokens}: engine {mixed_tok_s:.1f} tok/s, "
          f"transformers {hf_mixed:.1f} tok/s (prompt lengths {sorted(len(p) for p in mixed)})")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak_rss_mb:.0f} MB (both models in one process), threads={args.num_threads}, "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    print(json.dumps({
        "decode_b1_tok_s": round(b1, 2), "decode_b1_hf_tok_s": round(hf_b1, 2),
        "decode_b1_ratio": round(b1 / hf_b1, 3), "mixed_tok_s": round(mixed_tok_s, 2),
        "mixed_hf_tok_s": round(hf_mixed, 2), "mixed_ratio": round(mixed_tok_s / hf_mixed, 3),
        "peak_rss_mb": round(peak_rss_mb, 1),
    }))


if __name__ == "__main__":
    main()
