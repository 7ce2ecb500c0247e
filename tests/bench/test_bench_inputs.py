"""Workload specs and perf_analyzer export parsing of scripts/perf/. No server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from perf.pa_export_stats import records_from_export
from perf.workload import InterferenceConfig, chat_phase, interference_phase, make_prompt

from serving.schema import RETURN_FLAGS


def test_prompts_are_reproducible_distinct_and_sized_in_words() -> None:
    assert make_prompt(64, seed=3) == make_prompt(64, seed=3)
    assert make_prompt(64, seed=3) != make_prompt(64, seed=4)
    assert len(make_prompt(256, seed=0).split()) == 256


def test_chat_phase_spreads_requests_round_robin_over_slots() -> None:
    phase = chat_phase(concurrency=4, num_requests=8, prompt_tokens=16, max_tokens=4, seed=0)
    assert [r.slot for r in phase.requests] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert len({r.request_id for r in phase.requests}) == 8
    assert all(r.arrival_s is None for r in phase.requests)


def test_interference_long_prompts_arrive_at_a_fixed_interval() -> None:
    cfg = InterferenceConfig(num_decode_streams=2, num_long=3, long_interval_s=5.0, first_long_s=2.0)
    phase = interference_phase(cfg, max_decode_requests_per_stream=4, seed=0)
    longs = [r for r in phase.requests if r.kind == "long"]
    assert [r.arrival_s for r in longs] == [2.0, 7.0, 12.0]
    assert sum(r.kind == "decode" for r in phase.requests) == 8
    assert phase.stop_closed_loop_after_open


def _request(finish_reason: str) -> dict:
    # num_output_tokens: the tokens of each response (the vLLM convention)
    outputs = [{"text_output": " a", "num_output_tokens": 1, "num_input_tokens": 5, "finish_reason": "None"},
               {"text_output": " b", "num_output_tokens": 1, "num_input_tokens": 5,
                "finish_reason": finish_reason}]
    return {"timestamp": 1_000_000_000, "response_timestamps": [1_200_000_000, 1_250_000_000],
            "response_outputs": outputs}


def test_export_records_carry_ns_timestamps_as_seconds_and_flag_unended_streams() -> None:
    export = {"experiments": [{"requests": [_request("length"), _request("")]}]}
    ended, open_ = records_from_export(export)
    assert ended.ok and ended.num_output_tokens == 2 and ended.num_prompt_tokens == 5
    assert abs(ended.ttft_ms - 200.0) < 1e-6 and abs(ended.itls_ms[0] - 50.0) < 1e-6
    assert not open_.ok


def _fake_tool(path: Path, record: Path) -> Path:
    """An executable that writes its arguments, one a line, to ``record``, and copies its ``--input-data``
    file beside it (``record`` + ``.input``)."""
    path.write_text("#!/usr/bin/env bash\n"
                    f'printf "%s\\n" "$@" > "{record}"\n'
                    'while [[ $# -gt 0 ]]; do\n'
                    f'  if [[ "$1" == --input-data ]]; then cp "$2" "{record}.input"; fi; shift\n'
                    "done\n")
    path.chmod(0o755)
    return path


def test_perf_tools_ask_for_every_optional_output_the_public_models_declare(tmp_path: Path) -> None:
    """perf_analyzer's export of a declared output that a response lacks is uninitialized memory
    (``scripts/perf/genai_perf.sh`` says more): the requests ``perf_analyzer.sh`` and ``genai_perf.sh`` send
    (each run against a stand-in of its tool that records what it got) ask for every ``return_*`` flag the
    public models declare (``serving.schema.RETURN_FLAGS``: their auto-complete adds exactly those,
    ``tests/serving/test_response_schema.py``). The committed inputs hold no flag: a new output needs no edit
    there, nor in the scripts."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT_DIR": str(tmp_path / "out"), "PYTHON": sys.executable}
    for path in sorted((root / "scripts/perf/inputs").glob("*.json")):
        committed = json.loads(path.read_text())["data"]
        assert not [k for e in committed for k in e if k.startswith("return_")], path.name
        record = tmp_path / f"pa-{path.stem}"
        subprocess.run([str(root / "scripts/perf/perf_analyzer.sh"), "colocated", "1", str(path)], cwd=root,
                       env={**env, "PERF_ANALYZER": str(_fake_tool(tmp_path / "perf_analyzer", record))},
                       capture_output=True, timeout=60, check=False)   # pa_export_stats finds no export: fine
        sent = json.loads(Path(f"{record}.input").read_text())["data"]
        assert sent == [{**e, **{flag: [True] for flag in RETURN_FLAGS}} for e in committed], path.name
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    record = tmp_path / "genai-perf"
    proc = subprocess.run([str(root / "scripts/perf/genai_perf.sh"), "colocated", "1"], cwd=root,
                          env={**env, "GENAI_PERF": str(_fake_tool(tmp_path / "genai-perf-tool", record)),
                               "TOKENIZER": str(tokenizer)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    args = record.read_text().splitlines()
    extra = {args[i + 1] for i, arg in enumerate(args) if arg == "--extra-inputs"}
    assert extra == {f"{flag}:true" for flag in RETURN_FLAGS}
