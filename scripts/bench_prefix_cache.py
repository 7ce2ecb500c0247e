#!/usr/bin/env python
"""Prefix cache benchmark: a multi-turn chat workload on the colocated engine, in process, cache on vs off.

Workload: ``--conversations`` conversations of ``--turns`` turns over one shared system prompt (~``--system-
tokens`` tokens). Turn ``t`` of a conversation sends system + (user message, answer) of every earlier turn + a
new user message (token ids concatenated, no chat template), greedy, ``--output-tokens`` tokens (EOS ignored).
Requests run one at a time, so TTFT (``add_request`` → the first output carrying a token) is the prefill of
the uncached part of the prompt plus one step. Prints TTFT p50 of turn 1 and of turns 2+, with and without the
cache, and the ratio with / without for turns 2+.

    PYTHONPATH=. .venv/bin/python scripts/bench_prefix_cache.py   # 8 x 4 turns, 500-token system prompt
"""

from __future__ import annotations

import argparse
import statistics
import time

# the serving benchmark's workload text (scripts/ is on sys.path: this script's folder)
from perf.prefix_chat import SYSTEM_TEXT as _SYSTEM
from perf.prefix_chat import USER_MESSAGES as _USER

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model import LoadedModel, load_model


def ttfts(engine: LLMEngine, loaded: LoadedModel, args: argparse.Namespace) -> dict[int, list[float]]:
    """TTFT in seconds per turn index (0-based), over all conversations."""
    tok = loaded.tokenizer
    system = tok.encode(_SYSTEM * 8)[:args.system_tokens]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    history = {c: list(system) for c in range(args.conversations)}
    out: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    for turn in range(args.turns):
        for conv in range(args.conversations):
            user = tok.encode(
                f" Question {turn + 1} of visitor {conv + 1}: {_USER[(conv + turn) % len(_USER)]}")
            prompt = history[conv] + user
            rid = f"c{conv}t{turn}"
            start = time.perf_counter()
            engine.add_request(rid, prompt, params)
            answer: list[int] = []
            while engine.has_unfinished():
                for o in engine.step():
                    if o.new_token_ids and not answer:
                        out[turn].append(time.perf_counter() - start)
                    answer += o.new_token_ids
            history[conv] = prompt + answer
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args()
    loaded = load_model("smollm2")
    p50 = {}
    for cache in (False, True):
        engine = LLMEngine(EngineConfig(num_pages=1024, num_threads=args.num_threads,
                                        enable_prefix_caching=cache), loaded)
        engine.add_request("warmup", list(range(100, 164)), SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        by_turn = ttfts(engine, loaded, args)
        later = [t for turn, v in by_turn.items() if turn > 0 for t in v]
        p50[cache] = statistics.median(later)
        stats = engine.prefix_cache_stats()
        hit = stats.hits_tokens / stats.queries_tokens if stats.queries_tokens else 0.0
        print(f"cache={'on ' if cache else 'off'}  TTFT p50 turn 1: "
              f"{statistics.median(by_turn[0]) * 1e3:7.1f} ms  turns 2+: {p50[cache] * 1e3:7.1f} ms  prefix "
              f"hit rate (tokens): {hit:.2f}")
    print(f"TTFT p50 turns 2+, with / without cache: {p50[True] / p50[False]:.3f}")


if __name__ == "__main__":
    main()
