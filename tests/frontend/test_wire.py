"""The Triton wire contract, both generations of it: inputs asked only where the model declares them;
per-response counts (new servers) and cumulative counts (older servers) both decode to new tokens per
response; ``[n]`` outputs split into choices; logprobs JSON keeps the sampled token and its top-k by rank."""

from __future__ import annotations

import json

import numpy as np

from frontend.wire import BackendRequest, Contract, ResponseDecoder, Totals, parse_logprobs, request_arrays

NEW = Contract(frozenset({"text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                          "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                          "return_logprobs", "return_cumulative_logprob", "return_num_cached_tokens"}))
OLD = Contract(frozenset({"text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                          "apply_chat_template"}))


def _bytes(*items: str) -> np.ndarray:
    return np.array([s.encode() for s in items], dtype=np.object_)


def test_request_always_streams_excludes_the_prompt_and_sends_the_sampling_json() -> None:
    arrays = request_arrays(BackendRequest("r", "héllo", {"max_tokens": 4, "stop": ["\n"]}), OLD)
    assert set(arrays) == {"text_input", "stream", "exclude_input_in_output", "sampling_parameters"}
    assert arrays["text_input"][0] == "héllo".encode()
    assert arrays["stream"][0] and arrays["exclude_input_in_output"][0]
    assert json.loads(arrays["sampling_parameters"][0]) == {"max_tokens": 4, "stop": ["\n"]}
    assert all(a.shape == (1,) for a in arrays.values())


def test_return_flags_are_sent_only_where_declared_and_logprob_flags_only_when_wanted() -> None:
    plain = request_arrays(BackendRequest("r", "p", {}), NEW)
    assert {"return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
            "return_num_cached_tokens"} <= set(plain)
    assert "return_logprobs" not in plain
    assert {"return_logprobs",
            "return_cumulative_logprob"} <= set(request_arrays(BackendRequest("r", "p", {}, True), NEW))
    assert not any(
        name.startswith("return_") for name in request_arrays(BackendRequest("r", "p", {}, True), OLD))


def test_older_servers_cumulative_counts_become_new_tokens_per_response() -> None:
    decoder, totals = ResponseDecoder(OLD), Totals(1)
    for text, count, reason in (("A", 1, ""), ("BC", 3, ""), ("", 3, "stop")):
        values = {"text_output": _bytes(text), "finish_reason": _bytes(reason),
                  "num_input_tokens": np.array([7], np.int32),
                  "num_output_tokens": np.array([count], np.int32)}
        totals.add(decoder.decode(values, final=reason == "stop"))
    sample = totals.samples[0]
    assert "".join(sample.text) == "ABC" and sample.num_tokens == 3 and sample.finish_reason == "stop"
    assert totals.num_input_tokens == 7


def test_new_servers_send_n_entries_with_per_response_counts_and_none_until_the_end() -> None:
    values = {"text_output": _bytes("x", ""), "finish_reason": _bytes("None", "length"),
              "num_input_tokens": np.array([3], np.uint32), "num_output_tokens": np.array([2, 0], np.uint32)}
    response = ResponseDecoder(NEW).decode(values, final=False)
    assert [(d.index, d.text, d.finish_reason, d.num_new_tokens) for d in response.samples] == \
        [(0, "x", None, 2), (1, "", "length", 0)]
    again = ResponseDecoder(NEW)
    samples = again.decode(values, False).samples + again.decode(values, False).samples
    assert [d.num_new_tokens for d in samples] == [2, 0, 2, 0]   # per-response counts are never differenced


def test_cached_tokens_are_per_sample_and_the_prompt_counts_once_with_the_least_of_them() -> None:
    decoder, totals = ResponseDecoder(NEW), Totals(2)
    for texts, cached in ((("a", ""), [32, 0]), (("", "b"), [32, 16]), (("", ""), [32, 16])):
        values = {"text_output": _bytes(*texts), "num_cached_tokens": np.array(cached, np.uint32)}
        response = decoder.decode(values, final=False)
        assert [d.num_cached_tokens for d in response.samples] == cached
        totals.add(response)
    assert [s.counts["num_cached_tokens"] for s in totals.samples] == [32, 16]
    assert totals.num_cached_tokens == 16
    silent = Totals(1)
    silent.add(decoder.decode({"text_output": _bytes("x")}, final=True))
    assert "num_cached_tokens" not in silent.samples[0].counts and silent.num_cached_tokens is None


def test_an_empty_final_response_has_no_samples_and_absent_outputs_are_empty() -> None:
    assert ResponseDecoder(NEW).decode({}, final=True).samples == ()
    only_text = ResponseDecoder(NEW).decode({"text_output": _bytes("hi")}, final=False)
    assert only_text.samples[0].text == "hi" and only_text.samples[0].logprobs == ()
    assert only_text.num_input_tokens is None


def test_logprobs_keep_the_sampled_token_first_and_the_alternatives_by_rank() -> None:
    raw = json.dumps([{"42": {"logprob": -1.5, "rank": 3, "decoded_token": " b"},
                       "7": {"logprob": -0.1, "rank": 1, "decoded_token": " a"},
                       "9": {"logprob": -1.2, "rank": 2, "decoded_token": " c"}},
                      {"5": {"logprob": -0.01, "rank": 1, "decoded_token": "!"}}])
    first, second = parse_logprobs(raw)
    assert (first.token_id, first.token, first.logprob) == (42, " b", -1.5)
    assert first.top == ((" a", -0.1), (" c", -1.2), (" b", -1.5))
    assert second.token == "!" and second.top == (("!", -0.01),)
    assert parse_logprobs("null") == () and parse_logprobs("") == ()
