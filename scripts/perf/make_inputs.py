"""perf_analyzer ``--input-data`` files in the vLLM-backend interface (what ``colocated`` and ``pd_ensemble``
take), and the ``return_*`` flags the perf tools send.

The committed files (``scripts/perf/inputs/*.json``) hold the prompts: ``text_input``, ``stream``,
``sampling_parameters`` (JSON), ``exclude_input_in_output``. Prompts come from ``perf.workload.make_prompt``
(seeded words, about one token each), so the files are reproducible. The ``return_*`` flags are not in
them: ``scripts/perf/perf_analyzer.sh`` adds every flag of ``serving.schema.RETURN_FLAGS`` to each request at
run time (``--return-flags``), and ``scripts/perf/genai_perf.sh`` sends each as an extra input
(``--genai-perf-args``), so a new output needs no edit here. Why every flag: perf_analyzer's profile export
lists each declared output on every response and, for one a response does not carry, writes whatever its
buffer held (genai_perf.sh says more); ``pa_export_stats.py`` reads finish reason and token counts. Usage::

    .venv/bin/python scripts/perf/make_inputs.py                        # rewrites scripts/perf/inputs/*.json
    .venv/bin/python scripts/perf/make_inputs.py --return-flags IN OUT  # IN with every return_* flag, to OUT
    .venv/bin/python scripts/perf/make_inputs.py --genai-perf-args      # --extra-inputs return_...:true
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.workload import make_prompt  # noqa: E402
from serving.schema import RETURN_FLAGS  # noqa: E402

INPUTS_DIR = Path(__file__).resolve().parent / "inputs"

# file name → (number of prompts, prompt tokens, max_tokens)
FILES: dict[str, tuple[int, int, int]] = {
    "smoke.json": (4, 16, 8),
    "chat_256.json": (16, 256, 64),
    "long_2048.json": (4, 2048, 8),
}


def input_data(num_prompts: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict[str, list[dict]]:
    """perf_analyzer's input-data JSON: one entry per request, each input a one-element list ([1] dims); no
    ``return_*`` flag (``with_return_flags`` adds them)."""
    params = json.dumps({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    return {"data": [{"text_input": [make_prompt(prompt_tokens, seed + i)], "stream": [True],
                      "sampling_parameters": [params], "exclude_input_in_output": [True]}
                     for i in range(num_prompts)]}


def with_return_flags(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (perf_analyzer's input-data JSON) with every ``return_*`` flag of the schema set true on each
    request."""
    return {**data, "data": [{**entry, **{flag: [True] for flag in RETURN_FLAGS}} for entry in data["data"]]}


def genai_perf_args() -> list[str]:
    """genai-perf's arguments asking for every optional output: ``--extra-inputs return_...:true`` each."""
    return [arg for flag in RETURN_FLAGS for arg in ("--extra-inputs", f"{flag}:true")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--return-flags", nargs=2, metavar=("IN", "OUT"),
                       help="write IN with every return_* flag set to OUT")
    group.add_argument("--genai-perf-args", action="store_true", help="print genai-perf's --extra-inputs")
    args = parser.parse_args()
    if args.genai_perf_args:
        print("\n".join(genai_perf_args()))
        return
    if args.return_flags:
        source, dest = (Path(p) for p in args.return_flags)
        dest.write_text(json.dumps(with_return_flags(json.loads(source.read_text())), indent=1) + "\n")
        return
    INPUTS_DIR.mkdir(exist_ok=True)
    for seed, (name, (n, tokens, max_tokens)) in enumerate(FILES.items()):
        path = INPUTS_DIR / name
        path.write_text(json.dumps(input_data(n, tokens, max_tokens, seed * 1000), indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
