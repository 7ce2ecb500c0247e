"""Markdown tables of a ``bench_serving.py`` result JSON (for docs/benchmarks.md; figures are never typed by
hand).

Usage: ``.venv/bin/python scripts/perf/report.py docs/bench_serving.json``
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

_CHAT_COLS = (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("itl_p50_ms", "ITL p50 ms"),
              ("itl_p99_ms", "ITL p99 ms"), ("output_tokens_per_s", "out tok/s"),
              ("goodput_requests_per_s", "goodput req/s"), ("num_failed", "failed"))


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def chat_table(results: dict[str, Any]) -> str:
    """Workload (i): one row per deployment and concurrency."""
    lines = ["| deployment | concurrency | " + " | ".join(h for _, h in _CHAT_COLS) + " |",
             "|---|---|" + "---|" * len(_CHAT_COLS)]
    for name, res in results.items():
        for conc, summary in res.get("chat", {}).items():
            cells = " | ".join(_fmt(summary.get(k)) for k, _ in _CHAT_COLS)
            lines.append(f"| {name} | {conc} | " + cells + " |")
    return "\n".join(lines)


def interference_table(results: dict[str, Any]) -> str:
    """Workload (ii): decode-stream ITL and TTFT of both request kinds, per deployment."""
    lines = ["| deployment | decode ITL p50 ms | decode ITL p99 ms | decode ITL max in window ms | "
             "decode TTFT p50 ms | long TTFT p50 ms | long TTFT p99 ms | decode out tok/s | failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        inter = res.get("interference")
        if not inter:
            continue
        d, lg = inter["decode"], inter["long"]
        failed = d.get("num_failed", 0) + lg.get("num_failed", 0)
        lines.append(f"| {name} | {_fmt(d.get('itl_p50_ms'))} | {_fmt(d.get('itl_p99_ms'))} | "
                     f"{_fmt(inter.get('decode_itl_in_window_max_ms'))} | {_fmt(d.get('ttft_p50_ms'))} | "
                     f"{_fmt(lg.get('ttft_p50_ms'))} | {_fmt(lg.get('ttft_p99_ms'))} | "
                     f"{_fmt(d.get('output_tokens_per_s'))} | {_fmt(failed)} |")
    return "\n".join(lines)


def transfer_table(results: dict[str, Any]) -> str:
    """Transfer share of TTFT per prompt length (PD only)."""
    rows = results.get("pd", {}).get("transfer_share", {})
    lines = ["| prompt tokens | TTFT ms | KV transfer ms (first chunk → done) | share of TTFT "
             "| transfer tail ms (last chunk → done) | tail share of TTFT | KV MiB |",
             "|---|---|---|---|---|---|---|"]
    for row in rows.values():
        share, tail_share = row.get("transfer_share_of_ttft"), row.get("transfer_tail_share_of_ttft")
        lines.append(f"| {row.get('num_prompt_tokens')} | {_fmt(row.get('ttft_ms'))} | "
                     f"{_fmt(row.get('transfer_ms'))} | {'–' if share is None else f'{share:.1%}'} | "
                     f"{_fmt(row.get('transfer_tail_ms'))} | "
                     f"{'–' if tail_share is None else f'{tail_share:.1%}'} | "
                     f"{_fmt(row['transfer_bytes'] / 2**20 if row.get('transfer_bytes') else None)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    doc = json.loads(Path(parser.parse_args().result).read_text())
    results = doc["results"]
    errors = {name: res["error"] for name, res in results.items() if "error" in res}
    print(f"Conditions: {json.dumps(doc['conditions'])}; load average (1 min) before each deployment: "
          + ", ".join(f"{n} {r.get('loadavg_1m_before', '–')}" for n, r in results.items()))
    if errors:
        print(f"\nFailed deployments: {errors}")
    print(
        "\n" + chat_table(results) + "\n\n" + interference_table(results) + "\n\n" + transfer_table(results))
    print("\nLast line: `" + json.dumps(doc["summary"]) + "`")


if __name__ == "__main__":
    main()
