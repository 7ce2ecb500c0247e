"""The rolling restart (scripts/rolling_restart.py) of a 2P2D fleet with the tiny model under 8 streams with
20 % client cancels: the registry, each prefill and decode server, then the router (a surge replica joins the
clients' rotation, the old one drains), one at a time.

It must PASS: no failed request, no stream without FINAL, every KV page back on every worker, every stop clean
(no SIGKILL, within the exit timeout), the fleet whole again after each step, no crash report in any log; and
the drains must have been exercised (requests ran through every step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(1500)]


def test_a_rolling_restart_under_load_loses_nothing(tmp_path: Path) -> None:
    pytest.importorskip("pytriton")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "rolling_restart.py"), "--concurrency", "8",
         "--cancel-fraction", "0.2", "--max-new-tokens", "96", "--warmup-s", "3", "--settle-s", "1",
         "--log-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "rolling.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=1400, check=False)
    assert proc.returncode == 0 and "\nPASS\n" in proc.stdout, proc.stdout[-20000:] + proc.stderr[-5000:]
    summary = json.loads((tmp_path / "rolling.json").read_text())
    steps = ["registry", "prefill_0", "prefill_1", "decode_0", "decode_1", "router"]
    assert [s["server"] for s in summary["steps"]] == steps
    assert summary["errors"] == 0 and summary["streams_without_final"] == 0 and summary["completed_ok"] > 0
    assert summary["cancelled"] > 0   # the client's cancels ran through the restarts too
    assert all(p == 0 for p in summary["pages_by_worker"].values())
    assert not any(s["killed"] for s in summary["steps"]) and not summary["crash_reports"]
