"""``pd_ensemble`` (1P1D) in a real tritonserver with ``kv_backend: mooncake`` in the prefill and decode
``config.pbtxt`` (Mooncake's TCP transport on loopback).

Invariants: two concurrent greedy requests stream exactly the colocated engine's text; both workers registered
Mooncake endpoints at the bootstrap (the KV went over Mooncake, not NIXL) and the prefill side counted the
bytes; afterwards both pools are back at their size. Kept to two requests: the CI suite runs on 2 cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from live_client import metric_value, streams_match_reference
from live_prompts import colocated_greedy_texts
from perf.server import pd_model_repository
from test_pd_live import GREEDY, PROMPTS, generate

from bootstrap.client import BootstrapClient
from kv_transfer import unavailable_reason
from serving.router.discovery import LocalServerMembers

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.mooncake, pytest.mark.timeout(600),
              pytest.mark.skipif(unavailable_reason("mooncake") is not None,
                                 reason=str(unavailable_reason("mooncake")))]
TRITON_MODELS = ("pd_ensemble", "prefill", "decode")
MOONCAKE_PROMPTS = [PROMPTS[0], PROMPTS[-2]]


def make_model_repository(tmp_dir: Path) -> Path:
    """model_repository's PD models with ``kv_backend`` switched to mooncake (configuration only)."""
    return pd_model_repository(tmp_dir, "mooncake")


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(MOONCAKE_PROMPTS, GREEDY)


def test_mooncake_pd_streams_the_colocated_text(triton_server, reference) -> None:
    streams_match_reference(lambda p: generate(triton_server.grpc_url, p), MOONCAKE_PROMPTS, reference)
    url = triton_server.metrics_url
    assert metric_value(url, "pd_kv_transfer_bytes_total", model="prefill") > 0
    assert metric_value(url, "pd_kv_transfers_total", model="decode") >= len(MOONCAKE_PROMPTS)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _pools_full(url):
        time.sleep(0.05)
    assert _pools_full(url)


def test_both_workers_registered_mooncake_endpoints(triton_server) -> None:
    """Each worker's own rendezvous (found as the router finds it: repository index + describe) holds its
    registration with Mooncake's agent metadata."""
    source = LocalServerMembers(triton_server.grpc_url)
    try:
        members, fresh = source.members()
    finally:
        source.close()
    assert fresh and sorted(m.role for m in members) == ["decode", "prefill"], members
    for member in members:
        client = BootstrapClient(member.rendezvous_url, 5.0)
        try:
            registration = client.get_instance(member.instance_id)
        finally:
            client.close()
        assert registration is not None, member
        metadata = json.loads(registration.agent_metadata)   # Mooncake's: {"agent", "endpoint"}
        assert metadata["agent"] == registration.agent_name
        assert metadata["endpoint"].startswith("127.0.0.1:")


def _pools_full(url: str) -> bool:
    return all(metric_value(url, "pd_kv_free_pages", model=m)
               == metric_value(url, "pd_kv_total_pages", model=m) for m in ("prefill", "decode"))
