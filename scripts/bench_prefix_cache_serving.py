#!/usr/bin/env python
"""Prefix cache through real servers: multi-turn chat on PD and colocated, cache on vs off (issue #12).

The workload of ``scripts/bench_prefix_cache.py`` as text over gRPC streaming to the public models
(``pd_ensemble`` for PD, ``colocated``): ``--conversations`` conversations of ``--turns`` turns over one
shared system prompt (``--system-tokens``); turn ``t`` resends the system prompt + every earlier question and
the model's answer text + a new question (no chat template); greedy, exactly ``--output-tokens`` tokens
(``ignore_eos``). Requests go one at a time, turn by turn (every conversation's turn 1, then turn 2, ...):
each request runs alone, so its TTFT is the prefill of what the cache lacks, not queueing behind others.

Four configurations, each on its own fresh server (``scripts/serve.sh`` via ``perf.server.ServeScript`` on
free loopback ports, a private model repository with ``enable_prefix_caching`` set on ``prefill``,
``decode`` and ``colocated``), pinned as in ``bench_serving.py`` (PD: prefill core 0, decode core 1, one
torch thread each; colocated: both cores, ``--colo-threads``): ``pd_on``, ``pd_off``, ``colo_on``,
``colo_off``. Per request: client-side TTFT, and from the server's metrics the prefill model's
``pd_kv_transfer_bytes_total`` delta and the ``pd_prefix_cache_{queries,hits}_tokens_total`` deltas of each
engine model. Prints a table per configuration, the ratios against the targets (TTFT p50 turns 2+ on / off
<= 0.3; KV bytes per request on / off <= 1 - decode's hit rate) and, last, one JSON line.

    .venv/bin/python scripts/bench_prefix_cache_serving.py            # 8 x 4 turns, 500-token system prompt
    .venv/bin/python scripts/bench_prefix_cache_serving.py --quick    # 2 x 2 turns, 200-token system prompt
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # engine (the tokenizer)

import tritonclient.grpc.aio as grpcclient  # noqa: E402
from perf.prefix_chat import (  # noqa: E402 - needs scripts/ on sys.path
    CacheConfig,
    Chat,
    TurnResult,
    counters,
    delta,
    final_line,
    format_table,
    schedule,
    summarize_config,
    system_prompt,
)
from perf.server import (  # noqa: E402
    REPO_ROOT,
    ServeScript,
    build_model_repository,
    pin_process,
    scrape_metrics,
    stub_pids,
)
from perf.stream_client import send_request  # noqa: E402
from perf.workload import RequestSpec, make_prompt  # noqa: E402

logger = logging.getLogger("bench_prefix_cache_serving")
QUICK = {"conversations": 2, "turns": 2, "system_tokens": 200}
FULL = {"conversations": 8, "turns": 4, "system_tokens": 500}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 conversations x 2 turns, 200-token system prompt")
    p.add_argument("--conversations", type=int, default=None, help="default 8 (quick: 2)")
    p.add_argument("--turns", type=int, default=None, help="default 4 (quick: 2)")
    p.add_argument("--system-tokens", type=int, default=None, help="default 500 (quick: 200)")
    p.add_argument("--output-tokens", type=int, default=8, help="tokens per answer (EOS ignored)")
    p.add_argument("--configs", default="pd_on,pd_off,colo_on,colo_off", help="run in this order")
    p.add_argument("--colo-threads", type=int, default=2, help="torch threads of the colocated engine")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "artifacts" / "bench_prefix_cache_serving")
    p.add_argument("--out", type=Path, default=None, help="write the full result JSON here")
    a = p.parse_args(argv)
    for key, value in (QUICK if a.quick else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    try:
        a.configs = [CacheConfig.parse(n) for n in a.configs.split(",") if n.strip()]
    except ValueError as exc:
        p.error(str(exc))
    return a


def _page_size() -> int:
    """``page_size`` of model_repository/decode (the benchmark does not override it)."""
    config = (REPO_ROOT / "model_repository" / "decode" / "config.pbtxt").read_text()
    match = re.search(r'key:\s*"page_size",\s*value:\s*\{\s*string_value:\s*"(\d+)"', config)
    if match is None:
        raise RuntimeError("model_repository/decode/config.pbtxt has no page_size")
    return int(match.group(1))


def _settled_counters(url: str, models: tuple[str, ...], timeout_s: float = 5.0) -> dict[str, float | None]:
    """The counters once two scrapes 0.3 s apart agree (the engines publish on their loop's next tick)."""
    last = counters(scrape_metrics(url), models)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = counters(scrape_metrics(url), models)
        if now == last:
            return now
        last = now
    return last


async def _conversations(server: ServeScript, cfg: CacheConfig, chat: Chat, a: argparse.Namespace,
                         entry_model: str) -> list[TurnResult]:
    """Every turn of every conversation, one request at a time on one gRPC channel."""
    models = cfg.engine_models()
    results: list[TurnResult] = []
    async with grpcclient.InferenceServerClient(server.grpc_url) as client:
        warm = RequestSpec(request_id=f"{cfg.name}-warmup", kind="warmup", prompt=make_prompt(32, 999),
                           num_prompt_tokens=32, max_tokens=4)
        await send_request(client, entry_model, warm, a.request_timeout_s)   # tokenizers, NIXL handshake
        before = await asyncio.to_thread(_settled_counters, server.metrics_url, models)
        for turn, conv in schedule(a.conversations, a.turns):
            prompt = chat.prompt(conv, turn)
            spec = RequestSpec(request_id=f"{cfg.name}-c{conv}-t{turn}", kind="chat", prompt=prompt,
                               num_prompt_tokens=0, max_tokens=a.output_tokens)
            record = await send_request(client, entry_model, spec, a.request_timeout_s)
            after = await asyncio.to_thread(_settled_counters, server.metrics_url, models)
            ok = record.ok and record.num_output_tokens == a.output_tokens
            error = record.error or (None if ok else
                                     f"{record.num_output_tokens} tokens, not {a.output_tokens}")
            results.append(TurnResult(conv, turn, record.num_prompt_tokens, record.ttft_ms if ok else None,
                                      delta(before, after), record.text, error))
            logger.info("%s conv %d turn %d: %d prompt tokens, TTFT %s ms, %s", cfg.name, conv, turn,
                        record.num_prompt_tokens, f"{record.ttft_ms:.0f}" if ok else "-",
                        error or json.dumps(results[-1].counters))
            chat.answered(conv, prompt, record.text)
            before = after
    return results


def run_config(cfg: CacheConfig, system: str,
               a: argparse.Namespace) -> tuple[list[TurnResult], dict[str, Any]]:
    """Start ``cfg``'s server, pin its stubs, run the workload, stop it. Raises RuntimeError when it dies."""
    deployment = cfg.deployment_spec(a.colo_threads)
    with tempfile.TemporaryDirectory(prefix=f"bench-prefix-{cfg.name}-") as tmp:
        repo = build_model_repository(deployment, Path(tmp) / "models")
        server = ServeScript(",".join(deployment.models), a.log_dir / f"serve-{cfg.name}.log",
                             model_repository=repo)
        info: dict[str, Any] = {"loadavg_before": os.getloadavg()}
        try:
            server.start(a.ready_timeout_s)
            for model, cpus in deployment.cpus.items():
                for pid in stub_pids(repo / model):
                    pin_process(pid, cpus)
                    info.setdefault("pinned_cpus", {})[model] = sorted(os.sched_getaffinity(pid))
            results = asyncio.run(_conversations(server, cfg, Chat(system), a, deployment.entry_model))
            if not server.stub_pids():
                raise RuntimeError(f"{cfg.name}: server died (log: {server.log_path})")
        finally:
            info["stop_s"], info["stop_killed"] = server.stop(60.0)
        info["loadavg_after"] = os.getloadavg()
    return results, info


def _print_ratios(line: Mapping[str, Any]) -> None:
    def f(v: Any) -> str:
        return "—" if v is None else f"{v:.3f}"
    for dep in ("pd", "colo"):
        print(f"{dep}: TTFT p50 turns 2+ cache on / off = {f(line[f'{dep}_ttft_ratio_on_over_off'])} "
              f"(target <= 0.3: {line[f'{dep}_ttft_target_met']}); answers equal on/off: "
              f"{line[f'{dep}_answers_equal_on_off']}")
    print(f"pd: KV bytes per request cache on / off = {f(line['pd_kv_ratio_on_over_off'])} against "
          f"1 - decode hit rate = {f(line['pd_kv_bound_1_minus_decode_hit'])} "
          f"(target met: {line['pd_kv_target_met']}; with prompts rounded up to whole pages: "
          f"{f(line['pd_kv_bound_page_rounded'])}); "
          f"prefill hit rate {f(line['pd_prefill_hit_rate_on'])}, decode {f(line['pd_decode_hit_rate_on'])}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally that stops servers
    from engine.model.loader import load_tokenizer

    system = system_prompt(load_tokenizer(), a.system_tokens)
    started = time.time()
    results: dict[str, list[TurnResult]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    infos: dict[str, dict[str, Any]] = {}
    for cfg in a.configs:
        results[cfg.name], infos[cfg.name] = run_config(cfg, system, a)
        summaries[cfg.name] = summarize_config(results[cfg.name], cfg.engine_models())
        logger.info("%s: %s", cfg.name, json.dumps(summaries[cfg.name]))
    line = final_line(summaries, results, page_size=_page_size())
    line["loadavg_1m"] = {name: [info["loadavg_before"][0], info["loadavg_after"][0]]
                          for name, info in infos.items()}
    print(format_table(summaries, line["loadavg_1m"]))
    _print_ratios(line)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
        doc = {"args": {k: str(v) for k, v in vars(a).items()}, "commit": commit, "started_unix_s": started,
               "wall_s": time.time() - started, "servers": infos, "summaries": summaries, "summary": line,
               "requests": {name: [dataclasses.asdict(r) for r in rs] for name, rs in results.items()}}
        a.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
