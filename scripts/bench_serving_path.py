#!/usr/bin/env python
"""Serving-path benchmark: what the serving path itself costs, with compute made nearly free.

Builds a tiny random Llama (``perf/tiny_model.py``: SmolLM2's config with 1 layer, hidden 64; its tokenizer),
serves it from one tritonserver (``colocated``, ``prefill``, ``decode`` over NIXL, ``pd_ensemble`` with
``worker_endpoints`` true and ``pd_triton``, a copy with it false, over the same workers; the model
repository's ``model`` parameter pointing at the tiny folder; ``perf/server.py``'s harness), and measures in
one run, greedy, ``ignore_eos``, a tiny prompt:

* engine alone (offline, same model and engine settings as served): ITL p50 at 1 stream (time per decode
  step), tokens/s at ``--streams`` requests x ``--tokens`` new tokens submitted at once;
* ``colocated``, ``pd_ensemble`` (child requests to the workers' own endpoints,
  ``serving/workers/endpoint.py``) and ``pd_triton`` (child requests through tritonserver) over gRPC streaming
  (``perf/stream_client.py``), each path in turn: ITL p50 and TTFT p50 at 1 stream (``--single-requests``
  requests one after another), streamed tokens/s at ``--streams`` concurrent streams x ``--tokens`` tokens
  (tokens / first send to last FINAL);
* TTFT p50 interleaved: ``--single-requests`` rounds in which the three paths send one request each in turn,
  back to back, so that a drift of the host's speed reaches them alike (the paths' own phases run minutes
  apart).

The client asks for one optional output, each response's ``num_output_tokens`` (``--outputs all``: also
``finish_reason`` and ``num_input_tokens``). Then the ratios: PD tok/s / colocated, colocated tok/s / engine,
ITL - engine ITL (each path), PD TTFT - colocated TTFT (ms; interleaved, and between the paths' own phases),
and the same for ``pd_triton``. Where the time goes: for each served path, the CPU time each process
(tritonserver, every model's stub, this client) spent during the streams phase, per streamed token
(``psutil``), and how many of the cores were busy. Every figure line carries the 1-minute load average: on a
shared machine the figures are contended. The last line is one JSON object with every figure (``*_ms``,
``*_tok_s``) and ratio.

    PYTHONPATH=. .venv/bin/python scripts/bench_serving_path.py            # 32 streams x 128 tokens
    PYTHONPATH=. .venv/bin/python scripts/bench_serving_path.py --quick    # CI smoke: 4 x 16
    PYTHONPATH=. .venv/bin/python scripts/bench_serving_path.py --model smollm2   # the real model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS.parent) not in sys.path:   # the project's packages (engine, serving)
    sys.path.insert(0, str(SCRIPTS.parent))

from perf.server import Deployment, RunningServer, ServerPorts, free_ports  # noqa: E402
from perf.stats import RequestRecord, percentile, run_duration_s  # noqa: E402
from perf.stream_client import COUNT_ONLY, RETURN_FLAGS, grpcclient, run_phase_sync, send_request  # noqa: E402
from perf.tiny_model import build_tiny_llama  # noqa: E402
from perf.workload import Phase, RequestSpec  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

PROMPT = "Hi"
ENGINE_MODELS = ("colocated", "prefill", "decode")
REQUEST_TIMEOUT_S = 300.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help="'tiny' (built here, seeded) or a model name or folder ('smollm2')")
    p.add_argument("--seed", type=int, default=0, help="the tiny model's weights")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--single-requests", type=int, default=8, help="1-stream requests (ITL, TTFT)")
    p.add_argument("--quick", action="store_true", help="CI smoke: 4 streams x 16 tokens, 2 single requests")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--outputs", choices=("count", "all"), default="count",
                   help="the optional outputs the client asks for: 'count' (each response's "
                        "num_output_tokens, all it needs) or 'all' (also finish_reason and num_input_tokens: "
                        "3 more tensors per response, as bench_serving.py asks)")
    p.add_argument("--interleave-gap-ms", type=float, default=0.0,
                   help="pause between two requests of the interleaved TTFT rounds, ms (default none: as in "
                        "each path's own phase, where a client at concurrency 1 sends the next request as "
                        "the last one ends; after 50 ms pauses colocated's first token took twice as long on "
                        "a 2-core host)")
    p.add_argument("--engine-nice", type=int, default=None,
                   help="the served engines' engine_nice (default: the model repository's, -10); the engine "
                        "alone runs at this process's priority, on an otherwise idle machine")
    args = p.parse_args()
    if args.quick:
        args.streams, args.tokens, args.single_requests = 4, 16, 2
    return args


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_alone(model: str, args: argparse.Namespace) -> dict[str, float]:
    """ITL p50 at batch 1 (ms per step after the first token), this process's CPU time per batch-1 step (ms:
    far below the ITL when the machine is contended and the loop waits for a core) and tokens/s of ``streams``
    requests at once, on the engine the served models run (same page size, chunking, one torch thread)."""
    engine = LLMEngine(EngineConfig(model=model, num_pages=1024, num_threads=1))
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request("warmup", prompt, greedy(4))
    while engine.has_unfinished():
        engine.step()
    step_times: list[float] = []
    cpu_start_s = time.process_time()
    for i in range(args.single_requests):
        engine.add_request(f"single-{i}", prompt, greedy(args.tokens))
        while engine.has_unfinished():
            if any(o.new_token_ids for o in engine.step()):
                step_times.append(time.perf_counter())
        step_times.append(float("nan"))   # no gap across requests
    cpu_ms_per_step = (time.process_time() - cpu_start_s) * 1e3 / max(
        1, len(step_times) - args.single_requests)
    gaps = [(b - a) * 1e3 for a, b in zip(step_times, step_times[1:]) if a == a and b == b]
    for i in range(args.streams):
        engine.add_request(f"batch-{i}", prompt, greedy(args.tokens))
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return {"itl_p50_ms": percentile(gaps, 50), "tok_s": tokens / (time.perf_counter() - start),
            "cpu_ms_per_step": cpu_ms_per_step}


def _checked(records: list[RequestRecord], what: str) -> list[RequestRecord]:
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(records)} requests failed: {failed[0].error}")
    return records


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system, every thread) each process has used so far, seconds; a gone process is left
    out."""
    import psutil

    used = {}
    for name, pid in pids.items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        used[name] = times.user + times.system
    return used


def request_spec(model: str, name: str, max_tokens: int, slot: int = 0) -> RequestSpec:
    """One greedy request of ``PROMPT`` to ``model`` (``ignore_eos``: exactly ``max_tokens`` tokens)."""
    return RequestSpec(request_id=f"{model}-{name}", kind="decode", prompt=PROMPT, num_prompt_tokens=1,
                       max_tokens=max_tokens, slot=slot)


def return_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The optional outputs the client asks for (``--outputs``)."""
    return COUNT_ONLY if args.outputs == "count" else RETURN_FLAGS


def served(url: str, model: str, args: argparse.Namespace, pids: dict[str, int]) -> dict[str, float]:
    """ITL p50 and TTFT p50 at 1 stream, streamed tokens/s at ``streams`` concurrent streams, via ``model``;
    and where the CPU time of those streams went: ``cpu_us_per_token_<process>`` for each of ``pids`` (the
    server, each model's stub, ``client``: this process), microseconds per streamed token, and ``cores_busy``
    (their CPU seconds over the phase's wall time)."""
    def run(name: str, specs: tuple[RequestSpec, ...]) -> list[RequestRecord]:
        records = run_phase_sync(url, model, Phase(name, specs), REQUEST_TIMEOUT_S, return_flags(args))
        return _checked(records, f"{model} {name}")

    run("warmup", (request_spec(model, "warmup", 4),))
    single = run("single", tuple(request_spec(model, f"single-{i}", args.tokens)
                                 for i in range(args.single_requests)))
    before, began = cpu_seconds(pids), time.perf_counter()
    many = run("streams",
               tuple(request_spec(model, f"stream-{i}", args.tokens, i) for i in range(args.streams)))
    after, wall_s = cpu_seconds(pids), time.perf_counter() - began
    tokens = sum(r.num_output_tokens for r in many)
    spent = {name: after[name] - before[name] for name in after if name in before}
    return {"itl_p50_ms": percentile([g for r in single for g in r.itls_ms], 50),
            "ttft_p50_ms": percentile([r.ttft_ms for r in single], 50),
            "tok_s": tokens / run_duration_s(many),
            **{f"cpu_us_per_token_{name}": s * 1e6 / tokens for name, s in spent.items()},
            "cores_busy": sum(spent.values()) / wall_s}


async def _interleaved(url: str, entries: tuple[str, ...], rounds: int, tokens: int, gap_s: float,
                       flags: tuple[str, ...]) -> dict[str, list[float]]:
    ttfts: dict[str, list[float]] = {entry: [] for entry in entries}
    async with grpcclient.InferenceServerClient(url) as client:
        for i in range(rounds):
            for entry in entries:
                spec = request_spec(entry, f"interleaved-{i}", tokens)
                record = await send_request(client, entry, spec, REQUEST_TIMEOUT_S, flags)
                _checked([record], f"{entry} interleaved")
                ttfts[entry].append(record.ttft_ms)
                if gap_s:
                    await asyncio.sleep(gap_s)
    return ttfts


def interleaved_ttft(url: str, entries: tuple[str, ...], args: argparse.Namespace) -> dict[str, float]:
    """TTFT p50 of each of ``entries`` (model names), ms, from ``--single-requests`` rounds in which each
    sends one request in turn (back to back, or ``--interleave-gap-ms`` apart): a drift of the host's speed
    during the run (other tenants, frequency) then reaches every path alike, where each path's own single
    phase runs minutes apart from the others'."""
    ttfts = asyncio.run(_interleaved(url, entries, args.single_requests, args.tokens,
                                     args.interleave_gap_ms / 1000.0, return_flags(args)))
    return {entry: percentile(values, 50) for entry, values in ttfts.items()}


def ratios(fig: dict[str, float]) -> dict[str, float]:
    """The comparisons, from the unrounded figures: rates as quotients, latencies as differences (ms)."""
    return {"pd_over_colocated_tok_s": fig["pd_tok_s"] / fig["colocated_tok_s"],
            "colocated_over_engine_tok_s": fig["colocated_tok_s"] / fig["engine_tok_s"],
            "colocated_itl_minus_engine_ms": fig["colocated_itl_p50_ms"] - fig["engine_itl_p50_ms"],
            "pd_itl_minus_engine_ms": fig["pd_itl_p50_ms"] - fig["engine_itl_p50_ms"],
            "pd_ttft_minus_colocated_ms": fig["pd_ttft_p50_ms"] - fig["colocated_ttft_p50_ms"],
            "pd_ttft_minus_colocated_interleaved_ms":
                fig["pd_ttft_interleaved_p50_ms"] - fig["colocated_ttft_interleaved_p50_ms"],
            "pd_triton_over_colocated_tok_s": fig["pd_triton_tok_s"] / fig["colocated_tok_s"],
            "pd_triton_ttft_minus_colocated_ms": fig["pd_triton_ttft_p50_ms"] - fig["colocated_ttft_p50_ms"],
            "pd_triton_ttft_minus_colocated_interleaved_ms":
                fig["pd_triton_ttft_interleaved_p50_ms"] - fig["colocated_ttft_interleaved_p50_ms"]}


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=SCRIPTS,
                          capture_output=True, text=True,
                          check=False)
    return proc.stdout.strip() or "unknown"


def measure(model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    engine = engine_alone(model, args)
    figures.update({f"engine_{k}": v for k, v in engine.items()})
    print(f"engine alone      ITL p50 {engine['itl_p50_ms']:7.2f} ms  (CPU {engine['cpu_ms_per_step']:5.2f} "
          f"ms/step)  {engine['tok_s']:8.0f} tok/s   (load {load_1m()})", flush=True)
    http, grpc, metrics = free_ports(3)
    nice = {} if args.engine_nice is None else {"engine_nice": str(args.engine_nice)}
    # pd_triton: a second router over the same workers that reaches them through tritonserver
    # (worker_endpoints false), the path every child request took before the workers' own endpoints
    deployment = Deployment(name="path", entry_model="pd_ensemble",
                            models=(*ENGINE_MODELS, "pd_ensemble", "pd_triton"),
                            overrides={**{m: {"model": model, **nice} for m in ENGINE_MODELS},
                                       "pd_ensemble": {"worker_endpoints": "true"},
                                       "pd_triton": {"worker_endpoints": "false"}},
                            copies={"pd_triton": "pd_ensemble"})
    ports = ServerPorts(http=http, grpc=grpc, metrics=metrics)
    with RunningServer(deployment, ports, log_dir) as server:
        pids = {**server.processes(), "client": os.getpid()}
        for name, entry in (("colocated", "colocated"), ("pd", "pd_ensemble"), ("pd_triton", "pd_triton")):
            path = served(ports.grpc_url, entry, args, pids)
            server.check_alive(entry)
            figures.update({f"{name}_{k}": v for k, v in path.items()})
            print(f"{entry:<17} ITL p50 {path['itl_p50_ms']:7.2f} ms  TTFT p50 {path['ttft_p50_ms']:7.2f} ms "
                  f" {path['tok_s']:8.0f} tok/s   (load {load_1m()})", flush=True)
            split = {k.removeprefix("cpu_us_per_token_"): v for k,
                     v in path.items() if k.startswith("cpu_us_per")}
            print(f"{'':17} CPU per streamed token, us: " + ", ".join(
                f"{k} {v:.0f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1]) if v >= 5) +
                f"; total {sum(split.values()):.0f} ({path['cores_busy']:.2f} cores busy)", flush=True)
        paths = (("colocated", "colocated"), ("pd", "pd_ensemble"), ("pd_triton", "pd_triton"))
        interleaved = interleaved_ttft(ports.grpc_url, tuple(entry for _, entry in paths), args)
        for name, entry in paths:
            figures[f"{name}_ttft_interleaved_p50_ms"] = interleaved[entry]
        each = ", ".join(f"{entry} {interleaved[entry]:.2f} ms" for _, entry in paths)
        print(f"interleaved       TTFT p50 {each}   (load {load_1m()})", flush=True)
    return figures


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-serving-path-") as tmp:
        model = str(build_tiny_llama(Path(tmp) / "tiny", args.seed)) if args.model == "tiny" else args.model
        figures = measure(model, args, args.log_dir or Path(tmp) / "logs")
    compared = ratios(figures)
    print(f"PD / colocated tok/s {compared['pd_over_colocated_tok_s']:.2f}; colocated / engine tok/s "
          f"{compared['colocated_over_engine_tok_s']:.2f}; ITL - engine: colocated "
          f"{compared['colocated_itl_minus_engine_ms']:+.2f} ms, PD "
          f"{compared['pd_itl_minus_engine_ms']:+.2f} ms; PD TTFT - colocated TTFT "
          f"{compared['pd_ttft_minus_colocated_interleaved_ms']:+.1f} ms interleaved "
          f"({compared['pd_ttft_minus_colocated_ms']:+.1f} ms between their own phases); through "
          f"tritonserver (pd_triton): tok/s {compared['pd_triton_over_colocated_tok_s']:.2f}x colocated, "
          f"TTFT {compared['pd_triton_ttft_minus_colocated_interleaved_ms']:+.1f} ms interleaved "
          f"({compared['pd_triton_ttft_minus_colocated_ms']:+.1f})", flush=True)
    out: dict[str, Any] = {k: round(v, 3) for k, v in {**figures, **compared}.items()}
    out.update(model=args.model, streams=args.streams, tokens=args.tokens,
               single_requests=args.single_requests,
               outputs=args.outputs, interleave_gap_ms=args.interleave_gap_ms, engine_nice=args.engine_nice,
               load_1m=load_1m(), commit=commit())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
