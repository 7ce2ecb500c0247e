"""The LLM convention in full, live, on pd_ensemble (PD over NIXL) and colocated in one tritonserver:

* logprobs through PD equal colocated's (same greedy tokens, logprobs within 1e-4, same top tokens), the first
  token (computed by prefill) included, ``max_tokens=1`` included;
* the served configs declare the schema's outputs and ``return_*`` inputs (auto-complete added them);
* the vLLM backend's additional outputs: present only when asked, with its dtypes and per-response meaning;
* ``num_cached_tokens`` (ours): a long prompt sent again reports the prefix cache's hit (prefill's in PD),
  whole pages below the prompt length, per sample and on every response;
* the sampling controls on both paths: penalties change the text in the expected direction (and PD equals
  colocated under them: prefill's first token is penalised like the rest), ``min_tokens`` holds EOS back,
  ``logit_bias``, ``include_stop_str_in_output``, ``n=3`` with a seed gives three reproducible samples;
* keys we do not implement fail by name; streaming with ``exclude_input_in_output=false`` fails with the vLLM
  backend's own message.
"""

from __future__ import annotations

import json
import queue
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from live_client import RESPONSE_TIMEOUT_S, make_inputs

from serving.schema import CLIENT_OUTPUTS, RETURN_FLAGS, config_inputs, config_outputs

pytestmark = pytest.mark.live

TRITON_MODELS = ("pd_ensemble", "prefill", "decode", "colocated")
#: read by the triton_server fixture: model_repository/ itself, so that the served configs checked here are
#: what auto-complete declared (the other modules' servers get copies with complete configs)
SERVE_IN_PLACE = True
PATHS = ("pd_ensemble", "colocated")
PROMPTS = (
    "The capital of France is",
    "List the colors of the rainbow: red, orange, yellow, green, blue, indigo, violet. Again: red, orange,",
    "def fibonacci(n):\n    ",
)
#: every optional output of the schema asked
ALL_OUTPUTS = dict.fromkeys(RETURN_FLAGS, True)
NO_OUTPUTS = {name: False for name in ALL_OUTPUTS}


@dataclass
class Responses:
    """Every response of one request: its output arrays by name (absent outputs left out)."""

    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: str | None = None

    def texts(self, sample: int = 0) -> list[str]:
        return [o["text_output"].reshape(-1)[sample].decode() for o in self.outputs]

    def text(self, sample: int = 0) -> str:
        return "".join(self.texts(sample))

    def tokens(self, sample: int = 0) -> list[dict[str, Any]]:
        """One dict per generated token (the ``logprobs`` JSON entries, in order)."""
        out: list[dict[str, Any]] = []
        for o in self.outputs:
            entries = json.loads(o["logprobs"].reshape(-1)[sample].decode())
            out.extend(entries or [])
        return out


def infer(url: str, model: str, prompt: str, params: dict[str, Any], stream: bool = True,
          **flags: bool) -> Responses:
    """One request on its own gRPC stream, to FINAL; ``flags`` are BOOL inputs (no outputs asked by
    default)."""
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    result = Responses()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(model, make_inputs(prompt, params, stream, **{**NO_OUTPUTS, **flags}),
                                  enable_empty_final_response=True)
        while True:
            res, err = events.get(timeout=RESPONSE_TIMEOUT_S)
            if err is not None:
                result.error = err.message()
                return result
            final = res.get_response().parameters["triton_final_response"].bool_param
            names = [o.name for o in res.get_response().outputs]
            if names:
                result.outputs.append({name: res.as_numpy(name) for name in names})
            if final:
                return result
    finally:
        client.stop_stream()
        client.close()


def _greedy(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


def _chosen(token: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The sampled token of a ``logprobs`` entry: its first key (the vLLM backend's layout)."""
    key = next(iter(token))
    return int(key), token[key]


def test_the_served_configs_hold_the_schema(triton_server) -> None:
    """What tritonserver serves (``get_model_config``) declares each model's outputs and a public model's
    ``return_*`` inputs exactly as ``serving.schema`` does: its config.pbtxt has none, auto-complete added
    them (``tests/serving/test_response_schema.py`` holds model.py's ``auto_complete_config`` to the
    schema)."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        for model in TRITON_MODELS:
            config = client.get_model_config(model, as_json=True)["config"]
            served = {section: {e["name"]: (e["data_type"], [int(d) for d in e["dims"]])
                                for e in config[section]} for section in ("input", "output")}
            assert served["output"] == {e["name"]: (e["data_type"], e["dims"]) for e in config_outputs(model)}
            flags = {name: value for name, value in served["input"].items() if name.startswith("return_")}
            assert flags == {e["name"]: (e["data_type"], e["dims"]) for e in config_inputs(model)}, model
    finally:
        client.close()


@pytest.mark.parametrize("max_tokens", [1, 12])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_logprobs_through_pd_equal_colocated(triton_server, prompt, max_tokens) -> None:
    runs = {m: infer(triton_server.grpc_url, m, prompt, _greedy(max_tokens, logprobs=3, ignore_eos=True),
                     **ALL_OUTPUTS) for m in PATHS}
    for model, res in runs.items():
        assert res.error is None, (model, res.error)
        tokens = res.tokens()
        counts = [int(o["num_output_tokens"][0]) for o in res.outputs]
        assert len(tokens) == sum(counts) == max_tokens, model   # the first token's logprobs included
        assert all(c >= 1 for c in counts), f"{model}: a response without tokens: {counts}"
        for o in res.outputs:   # per response: one entry per token, rank-1 texts add up to the text
            entries = json.loads(o["logprobs"][0].decode())
            assert len(entries) == int(o["num_output_tokens"][0])
            assert "".join(_chosen(e)[1]["decoded_token"] for e in entries) == o["text_output"][0].decode()
        cumulative = float(res.outputs[-1]["cumulative_logprob"][0])
        assert cumulative == pytest.approx(sum(_chosen(t)[1]["logprob"] for t in tokens), abs=1e-4)
    pd, co = runs["pd_ensemble"], runs["colocated"]
    assert pd.text() == co.text()
    for i, (a, b) in enumerate(zip(pd.tokens(), co.tokens())):
        (ta, ea), (tb, eb) = _chosen(a), _chosen(b)
        assert ta == tb and ea["rank"] == eb["rank"] == 1, f"token {i}"
        assert ea["logprob"] == pytest.approx(eb["logprob"], abs=1e-4), f"token {i}"
        assert set(a) == set(b), f"token {i}: the same top tokens"
        for key in a:
            assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-4)
    assert float(pd.outputs[-1]["cumulative_logprob"][0]) == pytest.approx(
        float(co.outputs[-1]["cumulative_logprob"][0]), abs=1e-4)


@pytest.mark.parametrize("model", PATHS)
def test_additional_outputs_only_when_asked(triton_server, model) -> None:
    bare = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(6))
    assert bare.error is None and all(set(o) == {"text_output"} for o in bare.outputs)
    full = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(6), **ALL_OUTPUTS)
    assert full.error is None and len(full.outputs) >= 2
    for i, o in enumerate(full.outputs):
        assert set(o) == set(CLIENT_OUTPUTS)
        assert o["num_input_tokens"].dtype == np.uint32 and o["num_output_tokens"].dtype == np.uint32
        assert o["num_cached_tokens"].dtype == np.uint32 and o["num_cached_tokens"].shape == (1,)
        assert o["cumulative_logprob"].dtype == np.float32
        assert o["logprobs"][0] == b"null"   # no logprobs sampling parameter
        last = i == len(full.outputs) - 1
        assert o["finish_reason"][0].decode() == ("length" if last else "None")
    cumulative = [float(o["cumulative_logprob"][0]) for o in full.outputs]
    assert cumulative == sorted(cumulative, reverse=True) and len(set(cumulative)) == len(cumulative)
    assert sum(int(o["num_output_tokens"][0]) for o in full.outputs) == 6
    for name in ALL_OUTPUTS:   # each alone
        res = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(3), stream=False, **{name: True})
        assert res.error is None and set(res.outputs[0]) == {"text_output", name.removeprefix("return_")}


PAGE_SIZE = 16   # config.pbtxt's page_size of colocated and prefill


def _cached(res: Responses) -> list[list[int]]:
    """``num_cached_tokens`` of every response, one list of per-sample entries each."""
    return [o["num_cached_tokens"].reshape(-1).tolist() for o in res.outputs]


@pytest.mark.parametrize("model", PATHS)
def test_a_repeated_long_prompt_reports_the_prefix_caches_hit(triton_server, model) -> None:
    # unique, so that no earlier request of the module (or of the other path) has cached it
    prompt = f"Request {uuid.uuid4().hex} on {model}. " + " ".join(
        f"Room {i} has a blue door." for i in range(12))
    flags = {"return_num_cached_tokens": True, "return_num_input_tokens": True}
    first = infer(triton_server.grpc_url, model, prompt, _greedy(4, ignore_eos=True), **flags)
    again = infer(triton_server.grpc_url, model, prompt, _greedy(4, ignore_eos=True), **flags)
    assert first.error is None and again.error is None
    num_prompt = int(first.outputs[0]["num_input_tokens"][0])
    assert num_prompt >= 3 * PAGE_SIZE
    assert all(o["num_cached_tokens"].dtype == np.uint32 for o in first.outputs + again.outputs)
    assert len({c[0] for c in _cached(first)}) == 1, "every response"
    assert len({c[0] for c in _cached(again)}) == 1, "every response"
    hit = _cached(again)[0][0]
    assert _cached(first)[0][0] == 0
    assert 0 < hit < num_prompt and hit % PAGE_SIZE == 0 and hit >= num_prompt - 2 * PAGE_SIZE
    assert again.text() == first.text()
    # one entry per sample, each a prefill of the now-cached prompt
    samples = infer(triton_server.grpc_url, model, prompt, {**_greedy(2), "n": 2}, stream=False, **flags)
    assert samples.error is None and _cached(samples) == [[hit, hit]]


@pytest.mark.parametrize("model", PATHS)
def test_request_parameters_stand_in_for_the_sampling_tensor(triton_server, model) -> None:
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        inputs = make_inputs(PROMPTS[0], None, True, **NO_OUTPUTS)
        client.async_stream_infer(model, inputs, parameters={"max_tokens": 5, "temperature": "0"},
                                  enable_empty_final_response=True)
        texts = []
        while True:
            res, err = events.get(timeout=RESPONSE_TIMEOUT_S)
            assert err is None, err
            if res.get_response().outputs:
                texts.append(res.as_numpy("text_output")[0].decode())
            if res.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert "".join(texts) == infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(5)).text()


def _max_repeat(text: str) -> int:
    words = text.split()
    return max((words.count(w) for w in set(words)), default=0)


@pytest.mark.parametrize("key,value", [("repetition_penalty", 1.8), ("frequency_penalty", 1.5),
                                       ("presence_penalty", 1.5)])
def test_penalties_change_the_text_the_same_way_on_both_paths(triton_server, key, value) -> None:
    prompt = PROMPTS[1]
    plain = infer(triton_server.grpc_url, "colocated", prompt, _greedy(24, ignore_eos=True)).text()
    texts = {m: infer(triton_server.grpc_url, m, prompt, _greedy(24, ignore_eos=True, **{key: value})).text()
             for m in PATHS}
    assert texts["pd_ensemble"] == texts["colocated"], "PD and colocated penalise alike"
    assert texts["colocated"] != plain
    assert _max_repeat(texts["colocated"]) <= _max_repeat(plain)
    assert len(set(texts["colocated"].split())) >= len(set(plain.split()))


def test_seeded_sampling_gives_the_same_text_on_both_paths(triton_server) -> None:
    """Prefill draws the first token from the seed, decode the rest: the same stream of draws as colocated."""
    params = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 11, "ignore_eos": True}
    texts = {m: infer(triton_server.grpc_url, m, PROMPTS[1], params).text() for m in PATHS}
    assert texts["pd_ensemble"] == texts["colocated"] and texts["colocated"]


@pytest.mark.parametrize("model", PATHS)
def test_min_tokens_holds_eos_back(triton_server, model) -> None:
    eos_bias = {"2": 100.0}   # SmolLM2-Instruct's EOS, <|im_end|>
    stopped = infer(triton_server.grpc_url, model, "Hi", _greedy(16, logit_bias=eos_bias), **ALL_OUTPUTS)
    assert stopped.error is None
    assert sum(int(o["num_output_tokens"][0]) for o in stopped.outputs) == 1
    assert stopped.outputs[-1]["finish_reason"][0] == b"stop"
    held = infer(triton_server.grpc_url, model, "Hi", _greedy(16, logit_bias=eos_bias, min_tokens=5),
                 **ALL_OUTPUTS)
    assert held.error is None
    assert sum(int(o["num_output_tokens"][0]) for o in held.outputs) == 6   # five, then EOS
    assert held.outputs[-1]["finish_reason"][0] == b"stop"


@pytest.mark.parametrize("model", PATHS)
def test_logit_bias_and_stop_string_kept(triton_server, model) -> None:
    free = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(12, ignore_eos=True)).text()
    stop = free.split()[1]
    cut = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(12, ignore_eos=True, stop=[stop])).text()
    kept = infer(triton_server.grpc_url, model, PROMPTS[0],
                 _greedy(12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)).text()
    assert stop not in cut and kept == cut + stop
    banned = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(12, ignore_eos=True),
                   return_logprobs=False).text()
    first = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(1, logprobs=0),
                  return_logprobs=True).tokens()
    first_id = _chosen(first[0])[0]
    other = infer(triton_server.grpc_url, model, PROMPTS[0],
                  _greedy(12, ignore_eos=True, logit_bias={str(first_id): -100})).text()
    assert other != banned


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("model", PATHS)
def test_n_samples_with_a_seed_are_reproducible(triton_server, model, stream) -> None:
    params = {"max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}
    runs = [infer(triton_server.grpc_url, model, "Once upon a time", params, stream=stream,
                  return_finish_reason=True, return_num_output_tokens=True) for _ in range(2)]
    for res in runs:
        assert res.error is None
        assert all(o["text_output"].shape == (3,) for o in res.outputs)
        assert [res.outputs[-1]["finish_reason"][i] for i in range(3)] == [b"length"] * 3
        assert [sum(int(o["num_output_tokens"][i]) for o in res.outputs) for i in range(3)] == [10] * 3
        if not stream:
            assert len(res.outputs) == 1
    samples = [[r.text(i) for i in range(3)] for r in runs]
    assert samples[0] == samples[1], "seeded samples are reproducible"
    assert len(set(samples[0])) == 3, "and distinct"


@pytest.mark.parametrize("model", PATHS)
def test_unsupported_and_bad_keys_fail_by_name(triton_server, model) -> None:
    for params, needle in [({"guided_json": {}}, "guided_json"),
                           ({"structured_outputs": {"json": {"type": "nonsense"}}},
                            "structured_outputs.json"),
                           ({"lora_name": "x"}, "lora_name"), ({"logprobs": 21}, "logprobs"),
                           ({"n": 0}, "sampling_parameters.n"),
                           ({"min_tokens": 9, "max_tokens": 4}, "min_tokens")]:
        res = infer(triton_server.grpc_url, model, "Hi", params)
        assert res.error is not None and needle in res.error, (params, res.error)
    ok = infer(triton_server.grpc_url, model, "Hi", _greedy(2))
    assert ok.error is None and ok.text()


@pytest.mark.parametrize("model", PATHS)
def test_streaming_with_the_prompt_fails_with_the_vllm_message(triton_server, model) -> None:
    res = infer(triton_server.grpc_url, model, "Hi", _greedy(2), exclude_input_in_output=False)
    assert res.error == ("Error generating stream: When streaming, `exclude_input_in_output` = False "
                         "is not allowed.")


@pytest.mark.parametrize("model", PATHS)
def test_latency_and_length_histograms(triton_server, model) -> None:
    from live_client import metric_value

    res = infer(triton_server.grpc_url, model, PROMPTS[0], _greedy(8, ignore_eos=True))
    assert res.error is None
    for name in ("pd_time_to_first_token_seconds", "pd_time_per_output_token_seconds",
                 "pd_e2e_request_latency_seconds", "pd_request_prompt_tokens",
                 "pd_request_generation_tokens"):
        assert metric_value(triton_server.metrics_url, f"{name}_count", model=model) >= 1, name
    generated = metric_value(triton_server.metrics_url, "pd_request_generation_tokens_sum", model=model)
    assert generated >= 8
    ttft_sum = metric_value(triton_server.metrics_url, "pd_time_to_first_token_seconds_sum", model=model)
    e2e_sum = metric_value(triton_server.metrics_url, "pd_e2e_request_latency_seconds_sum", model=model)
    assert 0 < ttft_sum <= e2e_sum


def _free_pages(server: Any) -> dict[str, float]:
    from live_client import metric_value

    return {m: metric_value(server.metrics_url, "pd_kv_free_pages", model=m)
            for m in ("prefill", "decode", "colocated")}


@pytest.mark.parametrize("model", PATHS)
def test_cancelling_an_n_sample_stream_frees_every_sample(triton_server, model) -> None:
    import time

    from live_client import grpc_generate

    def settled() -> dict[str, float]:
        deadline = time.monotonic() + 30
        last = _free_pages(triton_server)
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = _free_pages(triton_server)
            if now == last:
                return now
            last = now
        return last

    before = settled()
    params = {"max_tokens": 300, "temperature": 1.0, "seed": 1, "n": 3, "ignore_eos": True}
    res = grpc_generate(triton_server.grpc_url, make_inputs(PROMPTS[1], params), model=model, cancel_after=4)
    assert res.error is None and not res.final_seen
    deadline = time.monotonic() + 30
    while _free_pages(triton_server) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _free_pages(triton_server) == before, "every sample's pages came back"
    ok = infer(triton_server.grpc_url, model, "Hi", _greedy(2))
    assert ok.error is None and ok.text()
