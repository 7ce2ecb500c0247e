"""The KV transfer benchmark runs end to end (two processes over NIXL) and prints the JSON keys the docs and
issue #3 name. A smoke run: one room per pass, no figure is checked here (figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.nixl
def test_bench_kv_transfer_prints_its_json_keys() -> None:
    pytest.importorskip("nixl")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_kv_transfer.py"), "--sizes", "128",
                           "--reps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("kv128_latency_ms", "kv128_overhead_ms", "kv128_memcpy_gbps", "kv128_thread_latency_ms",
                "kv128_wake_ms", "kv128_write_ms", "desc_prepped_us", "layout_v2_gbps", "layout_v1_gbps",
                "kv128_memcpy_page_gbps", "kv128_ratio_page", "layout_v2t_gbps", "kv128_memcpy_ceiling_gbps",
                "kv128_ceiling_ratio", "kv128_ratio_ceiling"):
        assert result[key] > 0, key
    assert result["inline_progress"] is True and result["cold"] is False and result["huge_pages"] is True


@pytest.mark.mooncake
def test_bench_kv_transfer_on_mooncake_prints_its_json_keys_and_where_the_time_goes() -> None:
    pytest.importorskip("mooncake")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_kv_transfer.py"), "--backend", "mooncake",
                           "--sizes", "128", "--reps", "1", "--scatter"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("kv128_latency_ms", "kv128_memcpy_gbps", "kv128_thread_latency_ms", "mooncake_raw_one_gbps",
                "mooncake_raw_pages_gbps", "mooncake_raw_memcpy_gbps"):
        assert result[key] > 0, key
    assert result["backend"] == "mooncake" and result["scatter"] is True
