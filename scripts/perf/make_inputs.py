"""Write perf_analyzer ``--input-data`` files in the vLLM-backend interface (what ``colocated`` and
``pd_ensemble`` take): ``text_input``, ``stream``, ``sampling_parameters`` (JSON),
``exclude_input_in_output``, and every ``return_*`` flag (``pa_export_stats.py`` reads finish reason and token
counts; the rest keeps perf_analyzer's export free of uninitialized values).

Prompts come from ``perf.workload.make_prompt`` (seeded words, about one token each), so the files are
reproducible; they are committed under ``scripts/perf/inputs/``. Usage::

    .venv/bin/python scripts/perf/make_inputs.py   # rewrites scripts/perf/inputs/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.workload import make_prompt  # noqa: E402

INPUTS_DIR = Path(__file__).resolve().parent / "inputs"

# file name → (number of prompts, prompt tokens, max_tokens)
FILES: dict[str, tuple[int, int, int]] = {
    "smoke.json": (4, 16, 8),
    "chat_256.json": (16, 256, 64),
    "long_2048.json": (4, 2048, 8),
}


def input_data(num_prompts: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict[str, list[dict]]:
    """perf_analyzer's input-data JSON: one entry per request, each input a one-element list ([1] dims)."""
    params = json.dumps({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    return {"data": [{"text_input": [make_prompt(prompt_tokens, seed + i)], "stream": [True],
                      "sampling_parameters": [params], "exclude_input_in_output": [True],
                      # every optional output (genai_perf.sh says why: perf_analyzer's export of an output
                      # a response lacks is uninitialized memory)
                      "return_finish_reason": [True], "return_cumulative_logprob": [True],
                      "return_logprobs": [True], "return_num_input_tokens": [True],
                      "return_num_output_tokens": [True], "return_num_cached_tokens": [True]}
                     for i in range(num_prompts)]}


def main() -> None:
    INPUTS_DIR.mkdir(exist_ok=True)
    for seed, (name, (n, tokens, max_tokens)) in enumerate(FILES.items()):
        path = INPUTS_DIR / name
        path.write_text(json.dumps(input_data(n, tokens, max_tokens, seed * 1000), indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
