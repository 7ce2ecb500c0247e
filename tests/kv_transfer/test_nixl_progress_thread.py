"""The decode side's NIXL progress thread (``NixlOptions.progress_thread_ms``): over TCP, a peer's WRITE lands
while the target's own threads never call into NIXL, and it does not without the thread (UCX's TCP transport
copies a remote write in only when the target's worker is progressed; docs/multihost.md). Each case runs in
its own process (``nixl_progress_child.py``), because UCX reads ``UCX_TLS`` once per process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kv_harness import MODEL_ID, smollm2_layout

from kv_transfer.backends import parse_options
from kv_transfer.config import KVArgs
from kv_transfer.nixl_transport import NixlOptions, NixlTransport, kv_may_cross_network
from kv_transfer.transport import OptionError

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")]

CHILD = Path(__file__).resolve().parent / "nixl_progress_child.py"


def _write_with_target_silent(progress_thread_ms: float, wait_s: float) -> dict[str, object]:
    """The child's JSON line. The child starts from no UCX_* variable of this process (an earlier in-process
    transport of the session leaves its own here, e.g. UCX_MM_ERROR_HANDLING, which a network-only child does
    not use), and its stdout may carry UCX's own lines (UCX logs to stdout, through C's buffer, which is
    flushed after Python's at exit unless PYTHONUNBUFFERED is set): the JSON line is the last one that is
    JSON, not the last line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run([sys.executable, str(CHILD), str(progress_thread_ms), str(wait_s)],
                         capture_output=True, env=env,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in the child's output: {out.stdout[-2000:]}"
    return json.loads(lines[-1])


def test_a_write_over_tcp_lands_with_the_targets_threads_silent() -> None:
    result = _write_with_target_silent(5.0, 5.0)
    assert result["state"] == "DONE" and result["landed"], result
    assert result["copy_threads"] == [0, 0]   # KV over the network: no copy threads (copy_threads_for)


def test_without_the_thread_the_same_write_waits_for_the_target() -> None:
    result = _write_with_target_silent(0.0, 1.0)
    assert result["state"] == "PROC" and not result["landed"], result


@pytest.fixture
def environ_restored() -> Iterator[None]:
    """``NixlTransport`` writes its UCX defaults into ``os.environ``; ``network_only`` ones must not reach the
    NIXL tests that run after this one in the same process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_only_a_decode_whose_kv_may_cross_the_network_runs_the_thread(environ_restored: None) -> None:
    def made(role: str, network_only: bool, hostname: str = "127.0.0.1") -> float:
        layout = smollm2_layout(num_pages=4)
        pool = np.zeros(layout.pool_bytes, np.uint8)   # not registered: ``create`` only configures
        args = KVArgs(instance_id=f"{role}-0", role=role, kv_base_ptr=pool.ctypes.data,
                      kv_nbytes=layout.pool_bytes, layout=layout, model_id=MODEL_ID, local_hostname=hostname)
        options = NixlOptions(network_only=network_only, progress_thread_ms=3.0)
        return NixlTransport.create(args, options)._progress_thread_ms

    assert made("decode", network_only=True) == 3.0
    assert made("decode", network_only=False) == 0.0          # loopback: peers on this host, cma
    assert kv_may_cross_network("10.0.0.7", network_only=False)
    assert not kv_may_cross_network("localhost", network_only=False)
    assert made("prefill", network_only=True) == 0.0


def test_the_option_parses_and_refuses_out_of_range() -> None:
    assert parse_options("nixl", {}) == NixlOptions(progress_thread_ms=5.0)
    assert parse_options("nixl", {"kv_progress_thread_ms": "0"}).progress_thread_ms == 0.0
    assert NixlOptions.parse({"kv_progress_thread_ms": "2"}, {"PD_KV_PROGRESS_THREAD_MS": "10"}) \
        == NixlOptions(progress_thread_ms=10.0)
    for bad in ("-1", "nan", "inf", "5000", "fast"):
        with pytest.raises(OptionError, match="kv_progress_thread_ms"):
            NixlOptions.parse({"kv_progress_thread_ms": bad})
