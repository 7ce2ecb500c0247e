"""Live smoke runs of the standard tools against a real tritonserver: every stream they open must end.

perf_analyzer (gRPC, ``--streaming``, ``scripts/perf/inputs/smoke.json``: 16-token prompts, ``max_tokens`` 8
with ``ignore_eos``) and genai-perf (synthetic 16-token prompts, 4 new tokens) each send 4 requests at
concurrency 2 through the wrappers in ``scripts/perf/``. Fails, naming it, when what
``scripts/install_perf_tools.sh`` installs (``scripts/test.sh`` runs it) is missing; skips instead with
``PD_TESTS_ALLOW_MISSING=1`` (``tests/conftest.py``). Uses the ``triton_server`` fixture of
``tests/serving/conftest.py`` (loaded below, not copied).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from perf.pa_export_stats import records_from_export

ROOT = Path(__file__).resolve().parents[2]
PERF_ANALYZER = ROOT / "tools" / "bin" / "perf_analyzer"
GENAI_PERF = ROOT / "tools" / "bin" / "genai-perf"
TOKENIZER = ROOT / ".cache" / "tokenizers" / "smollm2"
SMOKE_INPUT = ROOT / "scripts" / "perf" / "inputs" / "smoke.json"
NUM_REQUESTS = 4
RUN_TIMEOUT_S = 240.0

# pd_ensemble joins once its models exist in the repository.
ENTRY_MODELS = tuple(m for m in ("colocated", "pd_ensemble") if (ROOT / "model_repository" / m).is_dir())
TRITON_MODELS = tuple(dict.fromkeys(
    ["colocated"] + (["prefill", "decode", "pd_ensemble"] if "pd_ensemble" in ENTRY_MODELS else [])))

_spec = importlib.util.spec_from_file_location("serving_live_conftest",
                                               ROOT / "tests" / "serving" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_serving_conftest = sys.modules.setdefault("serving_live_conftest", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_serving_conftest)
triton_server = _serving_conftest.triton_server

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]


def _grpc_port(server: object) -> str:
    url: str = server.grpc_url  # type: ignore[attr-defined]
    return url.rsplit(":", 1)[1]


def _require(path: Path, how: str) -> None:
    """``path`` exists; else the test fails naming it and ``how`` to make it (skips with
    ``PD_TESTS_ALLOW_MISSING=1``): the set-up of ``scripts/test.sh`` installs it, so its absence is a broken
    set-up, not something to skip."""
    if path.exists():
        return
    message = f"{path} missing: {how}"
    if os.environ.get("PD_TESTS_ALLOW_MISSING") == "1":
        pytest.skip(message)
    pytest.fail(message)


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)


@pytest.mark.parametrize("model", ENTRY_MODELS)
def test_perf_analyzer_streams_all_end(triton_server: object, model: str, tmp_path: Path) -> None:
    """perf_analyzer exits 0, and each of its requests got all 8 tokens and a final finish_reason."""
    _require(PERF_ANALYZER, "run scripts/install_perf_tools.sh")
    proc = _run([str(ROOT / "scripts/perf/perf_analyzer.sh"), model, _grpc_port(triton_server),
                 str(SMOKE_INPUT),
                 "--concurrency-range", "2", "--request-count", str(NUM_REQUESTS)],
                {"OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export = json.loads((tmp_path / "profile_export.json").read_text())
    records = records_from_export(export)
    assert len(records) >= NUM_REQUESTS
    first_entry = json.loads(SMOKE_INPUT.read_text())["data"][0]
    max_tokens = json.loads(first_entry["sampling_parameters"][0])["max_tokens"]
    for record in records:
        assert record.ok, f"{record.request_id}: {record.error}"
        assert record.num_output_tokens == max_tokens


@pytest.mark.parametrize("model", ENTRY_MODELS)
def test_genai_perf_counts_every_request(triton_server: object, model: str, tmp_path: Path) -> None:
    """genai-perf exits 0 and reports every request it sent; each raw request ended with a finish_reason."""
    _require(GENAI_PERF, "run scripts/install_perf_tools.sh")
    _require(TOKENIZER / "tokenizer.json", "run scripts/install_perf_tools.sh after scripts/setup.sh")
    proc = _run([str(ROOT / "scripts/perf/genai_perf.sh"), model, _grpc_port(triton_server),
                 "--concurrency", "2", "--request-count", str(NUM_REQUESTS)],
                {"OUT_DIR": str(tmp_path), "ISL": "16", "OSL": "4"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [summary_path] = list(tmp_path.glob("*/profile_export_genai_perf.json"))
    assert json.loads(summary_path.read_text())["request_count"]["avg"] == NUM_REQUESTS
    records = records_from_export(json.loads((summary_path.parent / "profile_export.json").read_text()))
    assert len(records) == NUM_REQUESTS
    assert all(r.ok for r in records), [r.error for r in records]
