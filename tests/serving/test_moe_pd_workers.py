"""A tiny random DeepSeek-V3 (MLA: one latent KV "head" per token, no V plane) served 1P1D through the
router's orchestrator and real KV transfer (in-process and NIXL backends): the layouts the workers register
say ``kind=mla``, and the PD stream equals a colocated engine's greedy text, so the latent pages crossed
intact.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_pd_workers import Cluster, request

from kv_transfer import unavailable_reason
from serving.config import WorkerConfig
from serving.workers.pd_factory import create_pd_worker

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

VOCAB = 128
PROMPTS = ["t3 t17 t60 t5 t9", " ".join(f"t{(7 * i + 3) % VOCAB}" for i in range(37))]


def save_tiny_deepseek(folder: Path) -> Path:
    """A random DeepSeek-V3 of transformers' config (8 experts, top-2, one dense layer, a non-zero correction
    bias) with a whitespace word-level tokenizer over ``t0`` .. ``t127``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                              moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                              num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, initializer_range=0.1, max_position_embeddings=256,
                              bos_token_id=1, eos_token_id=2)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{k}": k for k in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_deepseek(tmp_path_factory.mktemp("tiny_deepseek_v3"))


@pytest.fixture(scope="module", params=["inprocess", pytest.param("nixl", marks=pytest.mark.nixl)])
def cluster(request: pytest.FixtureRequest, folder: Path) -> Iterator[Cluster]:
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    config = WorkerConfig(model=str(folder), page_size=4, num_pages=64, chunk_size=8,
                          max_num_batched_tokens=16, kv_backend=request.param, bootstrap_timeout_s=5.0,
                          waiting_timeout_s=5.0)
    ids = ("prefill-mla@127.0.0.1:1", f"decode-mla-{request.param}@127.0.0.1:1")
    prefill, decode = create_pd_worker("prefill", config, ids[0]), create_pd_worker("decode", config, ids[1])
    prefill.start()
    decode.start()
    yield Cluster(prefill, decode, ids)
    decode.stop()
    prefill.stop()


def colocated_text(folder: Path, prompt: str) -> str:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(folder), page_size=4, num_pages=64))
    engine.add_request("r", engine.tokenizer.encode(prompt), SamplingParams(max_tokens=20, temperature=0.0,
                                                                               ignore_eos=True))
    parts = []
    while engine.has_unfinished():
        parts += [o.new_text for o in engine.step()]
    return "".join(parts)


def test_mla_kv_crosses_pd_and_the_stream_equals_colocated(cluster: Cluster, folder: Path) -> None:
    for handle in (cluster.prefill, cluster.decode):
        layout = handle.kv_manager.args.layout
        assert (layout.kind, layout.num_planes, layout.num_kv_heads, layout.head_dim) == ("mla", 1, 1, 24)
    start = cluster.free_pages()
    for prompt in PROMPTS:
        deltas = cluster.generate(request(prompt, max_tokens=20, ignore_eos=True))
        assert not [d.error for d in deltas if d.error], deltas
        assert "".join(d.text for d in deltas) == colocated_text(folder, prompt), prompt
    assert cluster.wait_free(start) == start
