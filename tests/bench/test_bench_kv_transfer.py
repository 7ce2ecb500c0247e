"""Smoke runs of the KV transfer benchmark (two processes over NIXL, or Mooncake): one room per pass, so no
figure is judged here (figures: docs/benchmarks.md). What is checked is that the printed figures are
consistent with each other: the bytes are 128 tokens of the SmolLM2 layout, GB/s is bytes over the printed
latency, and each ratio is the quotient of the two rates printed beside it (transfer / memcpy: above 1 is
faster). The Mooncake run moves a bfloat16 engine's KV (``--dtype bfloat16``), the NIXL run float32's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# SmolLM2, fp32: one token's K and V of every layer (the benchmark's layout)
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4


def _run(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_kv_transfer.py"), "--sizes", "128",
                           "--reps", "1", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _near(value: float, expected: float) -> Any:
    """Printed figures are rounded to 3 decimals: equal within that rounding (and 2 %)."""
    return value == pytest.approx(expected, rel=0.02, abs=0.003)


def _check_kv128_figures(result: dict[str, Any], itemsize: int = 4) -> None:
    assert result["kv128_bytes"] == 128 * TOKEN_BYTES * itemsize // 4
    latency_s = result["kv128_latency_ms"] / 1e3
    assert _near(result["kv128_gbps"], result["kv128_bytes"] / latency_s / 1e9)
    assert _near(result["kv128_ratio"], result["kv128_gbps"] / result["kv128_memcpy_gbps"])
    memcpy_ms = result["kv128_bytes"] / (result["kv128_memcpy_gbps"] * 1e9) * 1e3
    assert _near(result["kv128_overhead_ms"], result["kv128_latency_ms"] - memcpy_ms)
    assert result["kv128_thread_latency_ms"] > 0


@pytest.mark.nixl
def test_smoke_bench_kv_transfer_figures_agree_with_each_other() -> None:
    pytest.importorskip("nixl")
    result = _run()
    _check_kv128_figures(result)
    assert _near(result["kv128_ratio_page"], result["kv128_gbps"] / result["kv128_memcpy_page_gbps"])
    assert _near(result["kv128_ratio_ceiling"], result["kv128_gbps"] / result["kv128_memcpy_ceiling_gbps"])
    assert _near(result["kv128_ceiling_ratio"],
                 result["kv128_memcpy_ceiling_gbps"] / result["kv128_memcpy_gbps"])
    assert _near(result["layout_v2_ratio"], result["layout_v2_gbps"] / result["layout_memcpy_gbps"])
    assert result["inline_progress"] is True and result["cold"] is False and result["huge_pages"] is True


@pytest.mark.mooncake
def test_smoke_bench_kv_transfer_on_mooncake_figures_agree_with_each_other() -> None:
    pytest.importorskip("mooncake")
    result = _run("--backend", "mooncake", "--scatter", "--dtype", "bfloat16")   # bf16 KV: half the bytes
    assert result["dtype"] == "bfloat16"
    _check_kv128_figures(result, itemsize=2)
    for key in ("mooncake_raw_one_gbps", "mooncake_raw_pages_gbps", "mooncake_raw_memcpy_gbps"):
        assert result[key] > 0, key
    assert result["backend"] == "mooncake" and result["scatter"] is True
