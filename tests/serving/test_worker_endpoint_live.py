"""The router reaches the workers at their own gRPC endpoints (``serving.workers.endpoint``), past
tritonserver, by default (``worker_endpoints`` true), and through tritonserver when told to, in one server:
``pd_ensemble`` (the default: the endpoints) and ``pd_triton`` (a copy of it with ``worker_endpoints`` false)
in front of the same ``prefill`` and ``decode``.

Invariants: both routers stream the colocated engine's greedy text; requests through ``pd_ensemble`` never
enter the workers' Triton models (Triton's own statistics count only the routers' ``describe`` calls there)
while the workers finish every one of them (their ``pd_requests_total``); requests through ``pd_triton`` enter
both Triton models once each; every page comes back.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import requests
from live_client import grpc_generate, make_inputs, metric_value, streams_match_reference
from test_pd_live import GREEDY, PROMPTS, reference  # noqa: F401  (reference is a fixture)

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]
TRITON_MODELS = ("pd_ensemble", "pd_triton", "prefill", "decode")
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
WORKERS = (("prefill", "prefill_0_0"), ("decode", "decode_0_0"))


def make_model_repository(tmp_dir: Path) -> Path:
    for name in ("pd_ensemble", "prefill", "decode"):
        shutil.copytree(REPOSITORY / name, tmp_dir / name)
    shutil.copytree(REPOSITORY / "pd_ensemble", tmp_dir / "pd_triton")
    config = tmp_dir / "pd_triton" / "config.pbtxt"
    text = config.read_text()
    for old, new in (('name: "pd_ensemble"', 'name: "pd_triton"'),
                     ('key: "worker_endpoints", value: { string_value: "true" }',
                      'key: "worker_endpoints", value: { string_value: "false" }')):
        assert old in text, old
        text = text.replace(old, new)
    config.write_text(text)
    return tmp_dir


def triton_executions(http_url: str, model: str) -> int:
    """Requests Triton ran through ``model`` (its statistics extension: successes + failures)."""
    stats = requests.get(f"{http_url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]
    return int(stats["inference_stats"]["success"]["count"]) + int(stats["inference_stats"]["fail"]["count"])


def finished(url: str) -> dict[str, float]:
    """Each worker's finished requests (0 before its first: the counter appears with it)."""
    def value(model: str, instance: str) -> float:
        try:
            return metric_value(url, "pd_requests_total", model=model, instance=instance, outcome="finished")
        except KeyError:
            return 0.0
    return {m: value(m, i) for m, i in WORKERS}


def test_the_router_uses_the_worker_endpoints_and_tritonserver_when_told(
        triton_server, reference) -> None:  # noqa: F811
    url, http = triton_server.metrics_url, triton_server.http_url
    before_triton = {m: triton_executions(http, m) for m, _ in WORKERS}
    before_done = finished(url)
    for router in ("pd_ensemble", "pd_triton"):
        streams_match_reference(lambda p,
                                r=router: grpc_generate(triton_server.grpc_url, make_inputs(p, GREEDY),
                                                        model=r), PROMPTS, reference)
        deadline = time.monotonic() + 10   # the workers publish their counters on their loop's ticks
        done = finished(url)
        while any(done[m] - before_done[m] < len(PROMPTS) for m in done) and time.monotonic() < deadline:
            time.sleep(0.1)
            done = finished(url)
        entered = {m: triton_executions(http, m) - before_triton[m] for m, _ in WORKERS}
        for model, _ in WORKERS:
            assert done[model] - before_done[model] == len(PROMPTS), (router, model, done, before_done)
            # only describe calls (a few per router start) entered Triton's models
            if router == "pd_ensemble":
                assert entered[model] < len(PROMPTS), (model, entered)
            else:
                assert entered[model] >= len(PROMPTS), (model, entered)
        before_done = done
        before_triton = {m: triton_executions(http, m) for m, _ in WORKERS}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            metric_value(url, "pd_kv_free_pages", model=m, instance=i)
            != metric_value(url, "pd_kv_total_pages", model=m, instance=i) for m, i in WORKERS):
        time.sleep(0.05)
    for m, i in WORKERS:
        assert metric_value(url, "pd_kv_free_pages", model=m, instance=i) \
            == metric_value(url, "pd_kv_total_pages", model=m, instance=i)
