#!/usr/bin/env python3
"""Cost of structured outputs: compile time (cold, cached), per-token mask cost, and TTFT / ITL with and
without a JSON-schema constraint on ``colocated`` and ``pd_ensemble`` (1P1D over NIXL), one run.

Part 1 (in process, SmolLM2's vocabulary): building the vocabulary description once; compiling a JSON schema
cold and cached; filling one token mask and accepting one token, per token, over a valid answer's tokens.
Part 2 (a real tritonserver from ``scripts/serve.sh``, the real SmolLM2): ``--requests`` sequential streaming
chat requests per (model, constraint), the two constraints interleaved, greedy, ``max_tokens`` tokens; TTFT =
first response, ITL = mean gap between later responses divided by the tokens they carry. Each figure is
printed next to its unconstrained baseline from the same run (``ratio``), with ``os.getloadavg()``.

    .venv/bin/python scripts/bench_structured.py [--requests 4] [--max-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "genres": {"type": "array", "items": {"type": "string", "enum": ["drama", "comedy", "action", "sci-fi"]},
               "maxItems": 3},
    "cast": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "role": {"type": "string", "maxLength": 30}},
        "required": ["name", "role"]}, "maxItems": 4},
    "rating": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["title", "year", "genres", "cast", "rating"]}
ANSWER = json.dumps({"title": "The Long Night", "year": 1999, "genres": ["drama", "sci-fi"],
                     "cast": [{"name": "Ann Lee", "role": "pilot"}, {"name": "Bo Kim", "role": "doctor"}],
                     "rating": 7.5})
PROMPT = "Describe a made-up movie as JSON with its title, year, genres, cast and rating."


def load() -> tuple[float, float, float]:
    return os.getloadavg()


def bench_in_process() -> dict[str, float]:
    """Vocabulary build, cold / cached compile (ms), mask + accept per token (us)."""
    from engine.model.loader import load_tokenizer
    from engine.structured import GrammarCompiler, GrammarState, StructuredSpec, fill_masks

    tokenizer = load_tokenizer()
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compiler.tokenizer()  # the tokenizer description, once per engine
    t1 = time.perf_counter()
    compiled = compiler.compile(spec)
    t2 = time.perf_counter()
    compiler.compile(spec)
    t3 = time.perf_counter()
    tokens = tokenizer.encode(ANSWER) + [tokenizer.eos_token_ids[0]]
    per_token = []
    for _ in range(5):
        state = GrammarState(compiled)
        start = time.perf_counter()
        for token in tokens:
            fill_masks([state], compiler.vocab_size)
            assert state.accept(token), token
        per_token.append((time.perf_counter() - start) / len(tokens))
    return {"vocab_build_ms": (t1 - t0) * 1e3, "compile_cold_ms": (t2 - t1) * 1e3,
            "compile_cached_ms": (t3 - t2) * 1e3,
            "mask_accept_per_token_us": statistics.median(per_token) * 1e6,
            "answer_tokens": len(tokens)}


def one_stream(url: str, model: str, params: dict[str, Any]) -> tuple[float, float, int]:
    """(TTFT s, ITL s per token, tokens) of one streamed chat request."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient
    from perf.stream_client import stream_inputs

    inputs = stream_inputs(PROMPT, json.dumps(params))
    flag = grpcclient.InferInput("apply_chat_template", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True], dtype=bool))
    inputs.append(flag)
    events: queue.Queue[tuple[Any, Any, float]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error, time.perf_counter())))
    start = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    try:
        client.async_stream_infer(model, [i for i in inputs], enable_empty_final_response=True)
        while True:
            result, error, at = events.get(timeout=600)
            if error is not None:
                raise RuntimeError(error.message())
            response = result.get_response()
            count = result.as_numpy("num_output_tokens")
            if count is not None and int(count.reshape(-1)[0]) > 0:
                stamps.append((at, int(count.reshape(-1)[0])))
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    tokens = sum(n for _, n in stamps)
    ttft = stamps[0][0] - start
    later = sum(n for _, n in stamps[1:])
    itl = (stamps[-1][0] - stamps[0][0]) / later if later else float("nan")
    return ttft, itl, tokens


def bench_serving(requests: int, max_tokens: int) -> list[dict[str, Any]]:
    from perf.server import ServeScript

    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench_structured-"))
    server = ServeScript("pd_ensemble,prefill,decode,colocated", log_dir / "server.log")
    server.start(600)
    try:
        for model in ("colocated", "pd_ensemble"):
            variants = {"free": {}, "json_schema": {"structured_outputs": {"json": SCHEMA}}}
            params = {label: {"max_tokens": max_tokens, "temperature": 0, **extra}
                      for label, extra in variants.items()}
            for label in variants:  # warm-up (and, constrained, the cold compile)
                one_stream(server.grpc_url, model, params[label])
            runs: dict[str, list[tuple[float, float, int]]] = {label: [] for label in variants}
            for _ in range(requests):  # interleaved, so that a drift of the host's load hits both alike
                for label in variants:
                    runs[label].append(one_stream(server.grpc_url, model, params[label]))
            for label, got in runs.items():
                rows.append({"model": model, "constraint": label,
                             "ttft_ms": statistics.median(r[0] for r in got) * 1e3,
                             "itl_ms": statistics.median(r[1] for r in got) * 1e3,
                             "tokens": statistics.median(r[2] for r in got), "loadavg": load()})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop(60.0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-serving", action="store_true", help="part 1 only")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    print(f"loadavg {load()}", flush=True)
    engine = bench_in_process()
    print(json.dumps({**engine, "loadavg": load()}), flush=True)
    rows = [] if args.skip_serving else bench_serving(args.requests, args.max_tokens)
    for model in ("colocated", "pd_ensemble"):
        free = next((r for r in rows if r["model"] == model and r["constraint"] == "free"), None)
        bound = next((r for r in rows if r["model"] == model and r["constraint"] == "json_schema"), None)
        if free and bound:
            print(f"{model}: json_schema/free TTFT ratio {bound['ttft_ms'] / free['ttft_ms']:.3f}, "
                  f"ITL ratio {bound['itl_ms'] / free['itl_ms']:.3f} (loadavg {bound['loadavg']})")
    if args.json:
        args.json.write_text(json.dumps({"in_process": engine, "serving": rows}, indent=1))


if __name__ == "__main__":
    main()
