"""TTFT / ITL / throughput from a perf_analyzer ``--profile-export-file`` (perf_analyzer prints none of them
for decoupled models, but the export holds every response's timestamp, in ns).

A request *ended* when its last response carries a ``finish_reason`` (``"length"`` or ``"stop"``): the models
put it on the last token's response, when asked (``return_finish_reason``; without it, a last response with
text counts as the end). Usage::

    .venv/bin/python scripts/perf/pa_export_stats.py artifacts/perf_analyzer/colocated/profile_export.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.stats import RequestRecord, Slo, run_duration_s, summarize  # noqa: E402

_NS = 1e-9


def _ended(request: dict[str, Any]) -> bool:
    """A request ended when its last response carries ``finish_reason`` ``length`` or ``stop``. A client that
    did not ask for ``finish_reason`` (genai-perf sends no ``return_finish_reason``) gets none:
    perf_analyzer's export then still lists the output, empty, on every response; a request ended when its
    last response carries text (the server's last response carries the last tokens)."""
    outputs = request.get("response_outputs") or []
    if not outputs:
        return False
    if any(o.get("finish_reason") for o in outputs):
        return str(outputs[-1].get("finish_reason", "")) in ("length", "stop")
    return bool(outputs[-1].get("text_output"))


def records_from_export(export: dict[str, Any]) -> list[RequestRecord]:
    """One ``RequestRecord`` per request of every experiment; a request that did not end gets ``error``."""
    records = []
    for e, experiment in enumerate(export["experiments"]):
        for i, req in enumerate(experiment["requests"]):
            outputs = req.get("response_outputs") or []
            times = [t * _NS for t, out in zip(req["response_timestamps"], outputs) if out.get("text_output")]
            # per response; perf_analyzer lists an output a response did not carry (not asked) as 0
            counts = [int(o.get("num_output_tokens", 0)) for o in outputs]
            tokens = sum(counts) if any(counts) else len(times)
            prompt = max((int(o.get("num_input_tokens", 0)) for o in outputs), default=0)
            ended = _ended(req)
            records.append(RequestRecord(
                request_id=f"{e}-{i}", kind="pa", num_prompt_tokens=prompt, sent_s=req["timestamp"] * _NS,
                token_times_s=times, num_output_tokens=tokens,
                done_s=req["response_timestamps"][-1] * _NS if req["response_timestamps"] else None,
                error=None if ended else "no final response with a finish_reason"))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    parser.add_argument("--slo-itl-p99-ms", type=float, default=250.0)
    args = parser.parse_args()
    records = records_from_export(json.loads(args.export.read_text()))
    summary = summarize(records, max(run_duration_s(records), 1e-9),
                        Slo(args.slo_ttft_ms, args.slo_itl_p99_ms))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
