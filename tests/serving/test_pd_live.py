"""``pd_ensemble`` (1P1D: ``prefill`` + ``decode`` over NIXL) in a real tritonserver, through tritonclient
gRPC streaming and HTTP.

Invariants: 8 concurrent greedy requests of mixed prompt lengths stream exactly the colocated engine's text
(which test_colocated_live checks against transformers); ``stream=false`` gives one response; every bad input
gives one error and ends its stream while a concurrent good request completes; a client cancel gives the pages
back on both instances; a fresh prompt moves exactly its KV bytes over NIXL (tokens x bytes per token); a
repeated long prompt moves only the page decode's prefix cache lacks. Teardown (conftest) fails the module if
the server does not shut down cleanly, i.e. if any request was left without FINAL.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from live_client import (
    grpc_generate,
    http_generate_stream,
    make_inputs,
    metric_value,
    streams_match_reference,
)
from live_prompts import BAD_INPUTS, colocated_greedy_texts
from live_prompts import PROMPTS as BASE_PROMPTS

from engine.model.hf_folder import read_hf_config
from engine.model.loader import (
    SMOLLM2_MODEL_ID,
    convert_gguf_cached,
    default_cache_root,
    load_tokenizer,
    smollm2_gguf_path,
)
from kv_transfer import KVLayout

pytestmark = [pytest.mark.live, pytest.mark.model, pytest.mark.nixl, pytest.mark.timeout(600)]
TRITON_MODELS = ("pd_ensemble", "prefill", "decode")
MODEL = "pd_ensemble"
MAX_TOKENS = 16
GREEDY = {"max_tokens": str(MAX_TOKENS), "temperature": "0"}  # string values, as genai-perf sends them
PROMPTS = BASE_PROMPTS + ["Name the planets of the solar system:", "x"]


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Greedy text of every prompt from one colocated engine run in-process, all prompts in one batch."""
    return colocated_greedy_texts(PROMPTS, GREEDY)


def generate(url: str, prompt: str | bytes, params: Any = None, **kwargs: Any) -> Any:
    cancel_after = kwargs.pop("cancel_after", None)
    extra = {"cancel_after": cancel_after} if cancel_after is not None else {}
    return grpc_generate(url, make_inputs(prompt, params if params is not None else GREEDY, **kwargs),
                         model=MODEL, **extra)


def test_eight_concurrent_streams_match_the_colocated_engine(triton_server, reference) -> None:
    assert len(PROMPTS) == 8
    results = streams_match_reference(lambda p: generate(triton_server.grpc_url, p), PROMPTS, reference)
    for res in results:
        assert res.finish_reasons[-1] in ("stop", "length") and not any(res.finish_reasons[:-1])
        assert res.num_output_tokens == sorted(res.num_output_tokens)


def _token_kv_bytes() -> int:
    """One token's K and V of every layer, in bytes, in the prefill model's KV layout (SmolLM2, fp32)."""
    folder = convert_gguf_cached(smollm2_gguf_path(), SMOLLM2_MODEL_ID, default_cache_root())
    config = read_hf_config(folder / "config.json", SMOLLM2_MODEL_ID)
    layout = KVLayout(num_layers=config.num_layers, num_pages=1, page_size=1,
                      num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, dtype="float32")
    return layout.page_bytes


def test_kv_crossed_over_nixl(triton_server) -> None:
    """A prompt no prefix cache can hold (its first token is fresh) moves exactly its own KV: prefill counts
    prompt tokens x one token's KV bytes (nothing skipped, nothing more), and one transfer on each side."""
    prompt = f"{uuid.uuid4().hex} The lighthouse keeper wrote down the weather every evening, " * 3
    num_tokens = len(load_tokenizer("smollm2").encode(prompt))
    res, moved = _one_transfer(triton_server, prompt)
    assert res.error is None and res.final_seen and res.text
    assert num_tokens > 2 * 16   # several pages and a partly filled last one: spans, not whole pages only
    assert moved["skipped_prefill"] == moved["skipped_decode"] == 0
    assert moved["hits_decode"] == moved["hits_prefill"] == 0
    assert moved["bytes"] == num_tokens * _token_kv_bytes()
    assert moved["transfers"] == moved["transfers_decode"] == 1


def test_non_streaming_is_one_response_with_the_prompt_first(triton_server, reference) -> None:
    prompt = PROMPTS[0]
    whole = generate(triton_server.grpc_url, prompt, stream=False)
    assert whole.error is None and whole.final_seen and len(whole.texts) == 1
    assert whole.text == prompt + reference[prompt]




def test_bad_inputs_fail_alone_while_a_good_request_completes(triton_server, reference) -> None:
    url = triton_server.grpc_url
    with ThreadPoolExecutor(len(BAD_INPUTS) + 1) as pool:
        good = pool.submit(generate, url, PROMPTS[3])
        bad = {name: pool.submit(generate, url, p, params, **flags)
               for name, (p, params, flags) in BAD_INPUTS.items()}
        for name, future in bad.items():
            res = future.result()
            assert res.error and not res.texts, name
        assert good.result().error is None and good.result().text == reference[PROMPTS[3]]
    assert "text_input" in bad["empty prompt"].result().error
    assert "beam_width" in bad["unknown parameter"].result().error
    assert "max_tokens" in bad["max_tokens 0"].result().error
    # a child's verdict on the request (decode's engine rejects it: error_kind "request") is not retried, and
    # reaches an HTTP client as Triton's INVALID_ARG: 400
    resp = requests.post(f"{triton_server.http_url}/v2/models/{MODEL}/generate", timeout=120,
                         json={"text_input": "hello", "sampling_parameters": '{"max_tokens": 100000}'})
    assert resp.status_code == 400 and resp.json()["error"], (resp.status_code, resp.text)
    _wait_until(lambda: _free_pages(triton_server) == _total_pages(triton_server))
    assert _free_pages(triton_server) == _total_pages(triton_server)


def test_cancel_mid_stream_gives_the_pages_back_on_both_sides(triton_server) -> None:
    _wait_until(lambda: _free_pages(triton_server) == _total_pages(triton_server))
    free_before = _free_pages(triton_server)
    res = generate(triton_server.grpc_url, PROMPTS[2], {"max_tokens": 400, "ignore_eos": True},
                   cancel_after=3)
    assert res.error is None and not res.final_seen and len(res.texts) == 3
    _wait_until(lambda: _free_pages(triton_server) == free_before)
    assert _free_pages(triton_server) == free_before
    after = generate(triton_server.grpc_url, "Hi", {"max_tokens": 2})
    assert after.error is None and after.final_seen  # the server still serves


def test_http_generate_stream(triton_server, reference) -> None:
    prompt = PROMPTS[1]
    body = {"text_input": prompt, "stream": True,
            "sampling_parameters": '{"max_tokens": 16, "temperature": 0}',
            "return_finish_reason": True, "return_num_output_tokens": True}
    events = http_generate_stream(triton_server.http_url, body, model=MODEL)
    assert all("error" not in e for e in events) and len(events) >= 2
    assert "".join(e["text_output"] for e in events) == reference[prompt]
    assert events[-1]["finish_reason"] in ("stop", "length")
    assert all(e["num_output_tokens"] >= 1 for e in events)   # the last response carries the last token too


#: ~20 pages of tokens that no other prompt here starts with; the variant differs in its first token only
LOG = "Notes from the keeper's log. " + " ".join(
    f"Day {i}: the lamp burned {i % 7 + 2} hours, the wind came from the {('north', 'west', 'south')[i % 3]}."
    for i in range(24))
LOG_CHANGED = "Letters" + LOG[len("Notes"):]


def _counters(server: Any) -> dict[str, float]:
    """The KV and prefix-cache counters of both instances (a series not published yet reads 0: the workers
    publish a counter once it first moves)."""
    def value(name: str, model: str) -> float:
        try:
            return metric_value(server.metrics_url, name, model=model)
        except KeyError:
            return 0.0

    return {"bytes": value("pd_kv_transfer_bytes_total", "prefill"),
            "transfers": value("pd_kv_transfers_total", "prefill"),
            "transfers_decode": value("pd_kv_transfers_total", "decode"),
            "skipped_prefill": value("pd_kv_skipped_pages_total", "prefill"),
            "skipped_decode": value("pd_kv_skipped_pages_total", "decode"),
            "hits_prefill": value("pd_prefix_cache_hits_tokens_total", "prefill"),
            "hits_decode": value("pd_prefix_cache_hits_tokens_total", "decode")}


def _one_transfer(server: Any, prompt: str) -> tuple[Any, dict[str, float]]:
    """Runs ``prompt`` alone; returns the result and the counter deltas it caused (waits for the transfer to
    be counted: the workers publish counters on their loop ticks)."""
    before = _counters(server)
    res = generate(server.grpc_url, prompt)
    _wait_until(lambda: _counters(server)["transfers"] >= before["transfers"] + 1
                and _counters(server)["transfers_decode"] >= before["transfers_decode"] + 1)
    time.sleep(0.3)   # the decode side publishes on its own tick
    after = _counters(server)
    return res, {k: after[k] - before[k] for k in after}


def test_same_long_prompt_twice_moves_only_the_uncached_tail(triton_server) -> None:
    """Issue #12: the second time, decode already holds every page but the one with the last prompt token
    (never shared): prefill sends only that page's filled slots (bytes on the metrics), both caches report the
    hit, and the text is the first text and the colocated engine's. A prompt whose first token differs reuses
    nothing."""
    reference = colocated_greedy_texts([LOG, LOG_CHANGED], GREEDY)
    first, d1 = _one_transfer(triton_server, LOG)
    second, d2 = _one_transfer(triton_server, LOG)
    assert first.error is None and second.error is None
    assert first.text == second.text == reference[LOG]
    assert d1["skipped_prefill"] == d1["skipped_decode"] == d1["hits_prefill"] == d1["hits_decode"] == 0
    skipped = d2["skipped_prefill"]
    assert skipped >= 10 and d2["skipped_decode"] == skipped
    assert d2["hits_decode"] == d2["hits_prefill"] == 16 * skipped   # page_size 16, page-aligned
    token_bytes = 30 * 2 * 3 * 64 * 4       # SmolLM2 layout, fp32: one token's K and V of every layer
    prompt_tokens = d1["bytes"] / token_bytes   # the first time: the whole prompt's KV, nothing more
    assert prompt_tokens == int(prompt_tokens) and 16 * skipped < prompt_tokens <= 16 * (skipped + 1)
    assert d2["bytes"] == (prompt_tokens - 16 * skipped) * token_bytes   # only the tail decode lacked
    changed, d3 = _one_transfer(triton_server, LOG_CHANGED)
    assert changed.error is None and changed.text == reference[LOG_CHANGED]
    assert d3["skipped_prefill"] == d3["hits_prefill"] == d3["hits_decode"] == 0
    assert d3["bytes"] >= (prompt_tokens - 8) * token_bytes   # (about) the whole prompt again


def _free_pages(server: Any) -> tuple[float, float]:
    return tuple(metric_value(server.metrics_url, "pd_kv_free_pages", model=m)  # type: ignore[return-value]
                 for m in ("prefill", "decode"))


def _total_pages(server: Any) -> tuple[float, float]:
    return tuple(metric_value(server.metrics_url, "pd_kv_total_pages", model=m)  # type: ignore[return-value]
                 for m in ("prefill", "decode"))


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_child_takes_the_routers_prompt_ids_over_grpc(triton_server, reference) -> None:
    """A direct decode request to the ``decode`` model whose text is one prompt and whose ``prompt_token_ids``
    are another's, with the fingerprint of this process's tokenizer (the router's): the stream is the other
    prompt's colocated text, so the ids crossed Triton and the server's tokenizer has the router's
    fingerprint; with another fingerprint, the text's."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    from engine.model.loader import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    text_prompt, id_prompt = PROMPTS[1], PROMPTS[0]
    assert reference[text_prompt] != reference[id_prompt]

    def decode_direct(fingerprint: str) -> str:
        arrays = {"text_input": np.array([text_prompt.encode()], dtype=np.object_),
                  "sampling_parameters": np.array([json.dumps(GREEDY).encode()], dtype=np.object_),
                  "bootstrap_room": np.array([4242], dtype=np.int64),
                  "prompt_token_ids": np.array(tokenizer.encode(id_prompt), dtype=np.int32),
                  "tokenizer_id": np.array([fingerprint.encode()], dtype=np.object_)}
        inputs = []
        for name, array in arrays.items():
            tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else
                                           {np.int64: "INT64", np.int32: "INT32"}[array.dtype.type])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        text = b""
        try:
            client.async_stream_infer("decode", inputs, enable_empty_final_response=True)
            while True:
                result, error = events.get(timeout=120)
                assert error is None, error
                out = result.as_numpy("text_output")
                error_out = result.as_numpy("error")
                assert error_out is None or not error_out.size, error_out.tobytes().decode()
                text += b"" if out is None else out.astype(np.uint8).tobytes()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return text.decode()
        finally:
            client.stop_stream()
            client.close()

    assert decode_direct(tokenizer.fingerprint) == reference[id_prompt]
    assert decode_direct("0" * 16) == reference[text_prompt]
