"""The serving-path benchmark (scripts/bench_serving_path.py): the tiny model's builder, and a smoke run.

The smoke run (``--quick``: 4 streams x 16 tokens on the tiny model, one tritonserver) judges no figure: on a
shared CPU they are contended. It checks that every path produced its figures and that each printed comparison
is computed from the figures printed beside it (quotients of rates, differences of latencies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from perf.tiny_model import TINY_SHAPE, build_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.model
def test_the_tiny_model_is_seeded_and_loads_with_smollm2s_tokenizer(tmp_path: Path) -> None:
    from engine.model import load_model
    from engine.model.loader import load_tokenizer

    first = build_tiny_llama(tmp_path / "a", seed=3)
    again = build_tiny_llama(tmp_path / "b", seed=3)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    loaded = load_model(str(first))
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.head_dim) == tuple(TINY_SHAPE.values())
    assert config.model_id == "tiny-smollm2-seed3"
    text = "What is the capital of France?"
    assert loaded.tokenizer.encode(text) == load_tokenizer("smollm2").encode(text)


def _near(value: float, expected: float) -> Any:
    """Printed figures are rounded to 3 decimals: equal within that rounding."""
    return value == pytest.approx(expected, rel=0.01, abs=0.003)


@pytest.mark.live
@pytest.mark.model
@pytest.mark.nixl
@pytest.mark.timeout(900)
def test_smoke_bench_serving_path_quick_ratios_come_from_its_figures() -> None:
    pytest.importorskip("nixl")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_serving_path.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=850, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in ("engine", "colocated", "pd", "pd_triton"):
        assert out[f"{path}_itl_p50_ms"] > 0 and out[f"{path}_tok_s"] > 0, path
    assert out["colocated_ttft_p50_ms"] > 0 and out["pd_ttft_p50_ms"] > 0
    assert _near(out["pd_over_colocated_tok_s"], out["pd_tok_s"] / out["colocated_tok_s"])
    assert _near(out["colocated_over_engine_tok_s"], out["colocated_tok_s"] / out["engine_tok_s"])
    assert _near(out["colocated_itl_minus_engine_ms"], out["colocated_itl_p50_ms"] - out["engine_itl_p50_ms"])
    assert _near(out["pd_itl_minus_engine_ms"], out["pd_itl_p50_ms"] - out["engine_itl_p50_ms"])
    assert _near(out["pd_ttft_minus_colocated_ms"], out["pd_ttft_p50_ms"] - out["colocated_ttft_p50_ms"])
    for path in ("colocated", "pd", "pd_triton"):
        assert out[f"{path}_ttft_interleaved_p50_ms"] > 0, path
    assert _near(out["pd_ttft_minus_colocated_interleaved_ms"],
                 out["pd_ttft_interleaved_p50_ms"] - out["colocated_ttft_interleaved_p50_ms"])
    assert _near(out["pd_triton_ttft_minus_colocated_interleaved_ms"],
                 out["pd_triton_ttft_interleaved_p50_ms"] - out["colocated_ttft_interleaved_p50_ms"])
    assert _near(out["pd_triton_over_colocated_tok_s"], out["pd_triton_tok_s"] / out["colocated_tok_s"])
    assert _near(out["pd_triton_ttft_minus_colocated_ms"],
                 out["pd_triton_ttft_p50_ms"] - out["colocated_ttft_p50_ms"])
    assert (out["streams"], out["tokens"], out["model"]) == (4, 16, "tiny")
    assert "load" in proc.stdout.splitlines()[0]   # every figure line carries the load average
