"""The router under more concurrent streams than any thread pool of the stub holds (64), with an admission
bound below that: every stream ends with FINAL, the admitted requests complete with the colocated text, the
rest get the "server busy" error at once, cancelled streams give their pages back, and the router keeps
serving afterwards.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from live_client import grpc_generate, make_inputs, metric_value
from live_prompts import colocated_greedy_texts

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]
TRITON_MODELS = ("pd_ensemble", "prefill", "decode")
REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
MAX_INFLIGHT, MAX_QUEUED = 24, 16
GREEDY = {"max_tokens": "8", "temperature": "0"}
#: the drain of the last test's server stop, seconds (serve.sh's ``DRAIN_TIMEOUT_S``)
DRAIN_TIMEOUT_S = 3.0
TRITON_ENV = {"DRAIN_TIMEOUT_S": "3"}
PROMPTS = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]


def make_model_repository(tmp_dir: Path) -> Path:
    for name in TRITON_MODELS:
        shutil.copytree(REPOSITORY / name, tmp_dir / name)
    config = tmp_dir / "pd_ensemble" / "config.pbtxt"
    text = config.read_text()
    for key, value in (("max_inflight_requests", MAX_INFLIGHT), ("max_queued_requests", MAX_QUEUED)):
        old = f'{{ key: "{key}", value: {{ string_value: "'
        start = text.index(old) + len(old)
        text = text[:start] + str(value) + text[text.index('"', start):]
    config.write_text(text)
    return tmp_dir


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return colocated_greedy_texts(PROMPTS, GREEDY)


def test_64_concurrent_streams_all_end_and_the_excess_gets_server_busy(triton_server, reference) -> None:
    url = triton_server.grpc_url
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda p: grpc_generate(url, make_inputs(p, GREEDY),
                                                        model="pd_ensemble"), prompts))
    ok = [(p, r) for p, r in zip(prompts, results) if r.error is None]
    busy = [r for r in results if r.error is not None and "server busy" in r.error]
    other = [r.error for r in results if r.error is not None and "server busy" not in r.error]
    assert all(r.final_seen or r.error for r in results)
    assert other == [] and busy, (len(ok), len(busy), other[:3])
    assert MAX_INFLIGHT <= len(ok) and len(ok) + len(busy) == 64
    assert all(r.final_seen and r.text == reference[p] for p, r in ok)
    assert metric_value(triton_server.metrics_url, "pd_router_rejections_total", reason="busy") == len(busy)


def test_cancels_under_load_give_every_page_back_and_the_router_keeps_serving(
        triton_server, reference) -> None:
    url = triton_server.grpc_url
    params = {"max_tokens": "200", "temperature": "0", "ignore_eos": "true"}

    def one(i: int):
        cancel_after = 2 if i % 3 == 0 else None
        return grpc_generate(url, make_inputs(PROMPTS[i % len(PROMPTS)], params), model="pd_ensemble",
                             **({"cancel_after": cancel_after} if cancel_after else {}))

    with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
        results = list(pool.map(one, range(MAX_INFLIGHT)))
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    metrics = triton_server.metrics_url
    deadline = time.monotonic() + 40

    def pools_full() -> bool:
        return all(metric_value(metrics, "pd_kv_free_pages", model=m)
                   == metric_value(metrics, "pd_kv_total_pages", model=m) for m in ("prefill", "decode"))
    while not pools_full() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pools_full()
    after = grpc_generate(url, make_inputs(PROMPTS[0], GREEDY), model="pd_ensemble")
    assert after.error is None and after.text == reference[PROMPTS[0]]


def test_a_server_stop_drains_then_ends_the_requests_in_flight(triton_server) -> None:
    """Last in the module: it stops the server. tritonserver waits for live requests before it finalizes the
    models; the server watch drains them for ``drain_timeout_s`` (``TRITON_ENV``: 3 s here) and then ends what
    is left (error + FINAL), so the stop takes the drain and seconds more, not the exit timeout."""
    params = {"max_tokens": "2000", "temperature": "0", "ignore_eos": "true"}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(grpc_generate, triton_server.grpc_url, make_inputs(p, params), "pd_ensemble")
                   for p in PROMPTS[:2]]
        time.sleep(3.0)   # both are decoding
        assert not any(f.done() for f in futures)
        elapsed, killed = triton_server.stop(40.0)
        results = [f.result(timeout=30) for f in futures]
    assert not killed and DRAIN_TIMEOUT_S <= elapsed < DRAIN_TIMEOUT_S + 12.0, elapsed
    assert all(r.error or r.final_seen for r in results), results
    assert all(r.error for r in results), results   # 2000 tokens do not fit 3 s + 3 s: cut at the deadline
