"""The ``colocated`` model in a real tritonserver, through tritonclient gRPC streaming and HTTP.

Invariants: concurrent greedy requests give the engine's own in-process text (and transformers' greedy text);
``stream=false`` gives one response; every bad input gives one error and ends its stream while a concurrent
good request completes; a client cancel gives the KV pages back; HTTP ``generate_stream`` works. Teardown
(conftest) fails the module if the server does not shut down cleanly, i.e. if any request was left without
FINAL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from live_client import grpc_generate, http_generate_stream, make_inputs, metric_value
from live_prompts import BAD_INPUTS, PROMPTS, colocated_greedy_texts

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.timeout(600)]
TRITON_MODELS = ("colocated",)
MAX_TOKENS = 16
GREEDY = {"max_tokens": str(MAX_TOKENS), "temperature": "0"}  # string values, as genai-perf sends them


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Greedy text of every prompt from one colocated engine run in-process, all prompts in one batch."""
    return colocated_greedy_texts(PROMPTS, GREEDY)


def test_concurrent_greedy_streams_match_the_engine(triton_server, reference) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: grpc_generate(triton_server.grpc_url,
                                                        make_inputs(p, GREEDY)), PROMPTS))
    for prompt, res in zip(PROMPTS, results):
        assert res.error is None and res.final_seen
        assert res.text == reference[prompt], prompt[:40]
        assert res.finish_reasons[-1] in ("stop", "length") and not any(res.finish_reasons[:-1])
        # streamed: one response per token here (whole words), the last one FINAL with the token count
        assert len(res.texts) >= min(2, res.num_output_tokens[-1]) and res.num_output_tokens == sorted(
            res.num_output_tokens)


@pytest.mark.reference
def test_engine_reference_matches_transformers_greedy(reference) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.model.loader import SMOLLM2_MODEL_ID, default_cache_root

    folder = Path(default_cache_root()) / SMOLLM2_MODEL_ID
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == reference[prompt]


def test_non_streaming_is_one_response_with_the_prompt_first(triton_server, reference) -> None:
    prompt = PROMPTS[0]
    whole = grpc_generate(triton_server.grpc_url, make_inputs(prompt, GREEDY, stream=False))
    assert whole.error is None and whole.final_seen and len(whole.texts) == 1
    assert whole.text == prompt + reference[prompt]
    bare = grpc_generate(triton_server.grpc_url, make_inputs(prompt, GREEDY, stream=False,
                                                               exclude_input_in_output=True))
    assert bare.texts == [reference[prompt]]




def test_a_repeated_prompt_hits_the_prefix_cache_with_the_same_text(triton_server, reference) -> None:
    """The prefix cache is on by default: a prompt sent again reuses its KV (counted on the metrics endpoint)
    and gives the same greedy text."""
    url, prompt = triton_server.metrics_url, PROMPTS[3]
    first = grpc_generate(triton_server.grpc_url, make_inputs(prompt, GREEDY))
    hits_before = _counter(url, "pd_prefix_cache_hits_tokens_total")
    queries_before = _counter(url, "pd_prefix_cache_queries_tokens_total")
    again = grpc_generate(triton_server.grpc_url, make_inputs(prompt, GREEDY))
    assert first.text == again.text == reference[prompt]
    _wait_until(lambda: _counter(url, "pd_prefix_cache_hits_tokens_total") > hits_before)
    hits = _counter(url, "pd_prefix_cache_hits_tokens_total") - hits_before
    queries = _counter(url, "pd_prefix_cache_queries_tokens_total") - queries_before
    assert 0 < hits < queries and hits % 16 == 0 and metric_value(url, "pd_kv_cached_pages") > 0


def test_bad_inputs_fail_alone_while_a_good_request_completes(triton_server, reference) -> None:
    url = triton_server.grpc_url
    with ThreadPoolExecutor(len(BAD_INPUTS) + 1) as pool:
        good = pool.submit(grpc_generate, url, make_inputs(PROMPTS[3], GREEDY))
        bad = {name: pool.submit(grpc_generate, url, make_inputs(p, params, **flags))
               for name, (p, params, flags) in BAD_INPUTS.items()}
        for name, future in bad.items():
            res = future.result()
            assert res.error and not res.texts, name
        assert good.result().error is None and good.result().text == reference[PROMPTS[3]]
    assert "text_input" in bad["empty prompt"].result().error
    assert "beam_width" in bad["unknown parameter"].result().error
    assert "max_tokens" in bad["max_tokens 0"].result().error
    # over HTTP the server closes the stream only after FINAL: the error response was the final one
    events = http_generate_stream(triton_server.http_url, {"text_input": "", "stream": True})
    assert len(events) == 1 and "text_input" in events[0]["error"]
    # the request's own error is Triton's INVALID_ARG: HTTP 400, not 500 (serving.delta.ErrorKind.REQUEST)
    resp = requests.post(f"{triton_server.http_url}/v2/models/colocated/generate",
                         json={"text_input": ""}, timeout=60)
    assert resp.status_code == 400 and "text_input" in resp.json()["error"], (resp.status_code, resp.text)


def test_cancel_mid_stream_gives_the_pages_back(triton_server) -> None:
    _wait_until(lambda: metric_value(triton_server.metrics_url, "pd_queue_requests", queue="running") == 0)
    free_before = metric_value(triton_server.metrics_url, "pd_kv_free_pages")
    cancelled_before = _cancelled(triton_server.metrics_url)
    res = grpc_generate(triton_server.grpc_url,
                        make_inputs(PROMPTS[2], {"max_tokens": 400, "ignore_eos": True}),
                        cancel_after=3)
    assert res.error is None and not res.final_seen and len(res.texts) == 3
    _wait_until(lambda: _cancelled(triton_server.metrics_url) == cancelled_before + 1
                and metric_value(triton_server.metrics_url, "pd_kv_free_pages") == free_before)
    assert _cancelled(triton_server.metrics_url) == cancelled_before + 1
    assert metric_value(triton_server.metrics_url, "pd_kv_free_pages") == free_before
    after = grpc_generate(triton_server.grpc_url, make_inputs("Hi", {"max_tokens": 2}))
    assert after.error is None and after.final_seen  # the server still serves


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _counter(metrics_url: str, name: str) -> float:
    """A counter's value; 0 before its first increment (a series appears when first incremented)."""
    try:
        return metric_value(metrics_url, name)
    except KeyError:
        return 0.0


def _cancelled(metrics_url: str) -> float:
    try:
        return metric_value(metrics_url, "pd_requests_total", outcome="cancelled")
    except KeyError:
        return 0.0


def test_http_generate_stream(triton_server, reference) -> None:
    prompt = PROMPTS[1]
    events = http_generate_stream(triton_server.http_url, {"text_input": prompt, "stream": True,
                                                           "sampling_parameters": '{"max_tokens": 16, '
                                                                                  '"temperature": 0}',
                                                           "return_finish_reason": True,
                                                           "return_num_output_tokens": True})
    assert all("error" not in e for e in events) and len(events) >= 2
    assert "".join(e["text_output"] for e in events) == reference[prompt]
    assert events[-1]["finish_reason"] in ("stop", "length")
    assert all(e["finish_reason"] == "None" for e in events[:-1])
    assert all(e["num_output_tokens"] >= 1 for e in events) and sum(
        e["num_output_tokens"] for e in events) <= 16
    # without the sampling_parameters input, the request's extra JSON fields are its sampling parameters
    by_fields = http_generate_stream(triton_server.http_url, {"text_input": prompt, "stream": True,
                                                              "max_tokens": 16, "temperature": 0})
    assert "".join(e["text_output"] for e in by_fields) == reference[prompt]
    assert all(set(e) >= {"text_output"} and "finish_reason" not in e for e in by_fields)


def test_http_generate_non_streaming(triton_server, reference) -> None:
    prompt = PROMPTS[1]
    body = {"text_input": prompt, "sampling_parameters": '{"max_tokens": "16", "temperature": "0"}'}
    resp = requests.post(f"{triton_server.http_url}/v2/models/colocated/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["text_output"] == prompt + reference[prompt]
