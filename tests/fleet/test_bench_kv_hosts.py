"""The two-host KV benchmark runs end to end (one room per size after the warm-ups) and prints the JSON keys
docs/multihost.md names (both raw TCP baselines), with every KV byte on the link. No figure is checked here
(figures: docs/multihost.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fleet.netns import unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.netns, pytest.mark.nixl]


def test_bench_kv_hosts_prints_its_json_keys(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("nixl._api")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bench_kv_hosts.py"), "--sizes", "128",
                           "--reps", "1",
                           "--log-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("rtt_ms", "tcp_stream_gbps", "kv128_ms", "tcp128_ms", "kv128_ratio", "kv128_overhead_ms",
                "kv128_post_ms", "tcp128_landed_ms", "kv128_landed_ratio", "kv128_landed_overhead_ms"):
        assert result[key] > 0 or key.endswith("overhead_ms"), key
    assert result["kv128_link_bytes_ratio"] >= 1.0 and result["network_only"] is True
