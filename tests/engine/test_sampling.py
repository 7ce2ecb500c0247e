"""SamplingParams validation and wire parsing; Sampler invariants (greedy, top-k/top-p support, seeds)."""

import pytest
import torch

from engine.errors import InvalidSamplingParams
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_out_of_range_values_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_the_largest_seed_a_generator_takes_is_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_defaults_and_normalisation():
    p = SamplingParams(stop="x", top_k=0)
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0
    assert p.stop == ("x",) and p.top_k == -1 and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_from_dict_accepts_genai_perf_strings():
    p = SamplingParams.from_dict({"max_tokens": "32", "temperature": "0.5", "top_k": "5", "top_p": "0.9",
                                  "ignore_eos": "true", "seed": "7", "stop": "\n", "stop_token_ids": ["2"]})
    assert p == SamplingParams(max_tokens=32, temperature=0.5, top_k=5, top_p=0.9, ignore_eos=True, seed=7,
                               stop=("\n",), stop_token_ids=(2,))


def test_from_dict_none_means_default():
    assert SamplingParams.from_dict({"seed": None, "max_tokens": 4}) == SamplingParams(max_tokens=4)


@pytest.mark.parametrize("d, param", [
    ({"max_token": 3}, "max_token"), ({"max_tokens": "three"}, "max_tokens"),
    ({"max_tokens": [3]}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"ignore_eos": "maybe"}, "ignore_eos"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"max_tokens": "0"}, "max_tokens"),
])
def test_from_dict_rejects_unknown_keys_and_wrong_types(d, param):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams.from_dict(d)
    assert e.value.param == param


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 3
    res = Sampler()(logits, params, _gens(3))
    assert res.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1)[:, None]).squeeze(1)
    assert res.logprobs == pytest.approx(expected.tolist(), abs=1e-5)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    top_k = {sampler(logits, [SamplingParams(top_k=2)], [gen]).token_ids[0] for _ in range(200)}
    assert top_k == {0, 1}
    # softmax mass of the top two is ~0.91: top_p=0.7 keeps tokens 0 and 1 only
    top_p = {sampler(logits, [SamplingParams(top_p=0.7)], [gen]).token_ids[0] for _ in range(200)}
    assert top_p == {0, 1}


def test_same_seed_same_tokens_regardless_of_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=42)
    gen_alone = torch.Generator().manual_seed(42)
    alone = [Sampler()(logits[2:3], [seeded], [gen_alone]).token_ids[0] for _ in range(5)]
    gens = _gens(4, seed=100)
    gens[2] = torch.Generator().manual_seed(42)
    params = [SamplingParams(), SamplingParams(temperature=0), seeded, SamplingParams(top_k=3)]
    mixed = [Sampler()(logits, params, gens).token_ids[2] for _ in range(5)]
    assert mixed == alone


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(3)
    draws = [Sampler()(logits, [SamplingParams()], [gen]).token_ids[0] for _ in range(2000)]
    assert draws.count(0) / 2000 == pytest.approx(0.7, abs=0.05)
