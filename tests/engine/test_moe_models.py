"""DeepSeek-V3 (MLA + grouped sigmoid MoE) and Qwen3-MoE (q/k-norm GQA + softmax MoE) in the engine equal
transformers: tiny random models made with transformers' own configs (8 experts, top-2, one dense layer
first, init std 0.1 so every head and expert matters, a non-zero ``e_score_correction_bias``), saved with
``save_pretrained`` and loaded from the folder. Greedy tokens equal transformers' greedy ``generate`` (fp32)
for held prompts batched, with chunked prefill, through the paged KV (20 decode steps), and for MLA through a
prefill engine then a decode engine (the latent pages copied). Expert-routing ties break as
``torch.topk`` breaks them, as transformers' routers do; a config the engine cannot serve fails naming the
field.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model import ModelLoadError, load_model
from engine.model.moe_config import MoEConfig
from engine.model.moe_routing import route

pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

VOCAB = 128
PAGE_SIZE = 4
NEW_TOKENS = 20
PROMPTS = {"p1": [7], "p5": [3, 17, 60, 5, 9], "p13": list(range(20, 33)),
           "p29": [(11 * i + 5) % VOCAB for i in range(29)]}


def _common() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_experts_per_tok=2, initializer_range=0.1,
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def deepseek_config(**overrides):  # -> transformers.DeepseekV3Config
    from transformers import DeepseekV3Config

    fields = dict(_common(), num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=4,
                  topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5)
    return DeepseekV3Config(**{**fields, **overrides})


def qwen3_moe_config(**overrides):  # -> transformers.Qwen3MoeConfig
    from transformers import Qwen3MoeConfig

    fields = dict(_common(), num_key_value_heads=2, head_dim=16, num_experts=8, mlp_only_layers=[0],
                  norm_topk_prob=True)
    return Qwen3MoeConfig(**{**fields, **overrides})


def save_model(folder: Path, config, seed: int = 0, tie_gate: tuple[int, ...] = ()):
    """A random model of ``config`` saved into ``folder`` with a whitespace word-level tokenizer over ``t0``
    .. ``t127`` (so that a server can take text); returns it (eval). DeepSeek's correction bias is random
    (0.1 std); ``tie_gate``: these experts get the first one's router row (and bias), so their scores tie
    exactly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.1)
            for e in tie_gate[1:]:
                gate.weight[e] = gate.weight[tie_gate[0]]
                if bias is not None:
                    bias[e] = bias[tie_gate[0]]
    model.save_pretrained(folder)
    tokenizer = HFTokenizer(models.WordLevel({f"t{k}": k for k in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    return model


def reference_tokens(model, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt alone, EOS not stopping."""
    model.generation_config.eos_token_id = None
    out = {}
    with torch.inference_mode():
        for rid, p in prompts.items():
            gen = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            out[rid] = gen[0, len(p):].tolist()
    return out


def make_engine(folder: Path, mode: str = "colocated", chunk_size: int = 512) -> LLMEngine:
    cfg = EngineConfig(model=str(folder), mode=mode, page_size=PAGE_SIZE, num_pages=96, chunk_size=chunk_size,
                       max_num_batched_tokens=max(chunk_size, 64))
    return LLMEngine(cfg)


def run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("deepseek_v3")
    return folder, reference_tokens(save_model(folder, deepseek_config()), PROMPTS)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    return folder, reference_tokens(save_model(folder, qwen3_moe_config()), PROMPTS)


@pytest.mark.parametrize("arch", ["deepseek", "qwen3_moe"])
@pytest.mark.parametrize("chunk_size", [512, 8])
def test_batched_greedy_tokens_equal_transformers(arch: str, chunk_size: int, request) -> None:
    """All prompts in one continuous batch, whole or in chunks of 8 tokens, pages of 4: transformers'
    tokens; every page comes back."""
    folder, reference = request.getfixturevalue(arch)
    engine = make_engine(folder, chunk_size=chunk_size)
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, greedy())
    assert {rid: tokens(o) for rid, o in run(engine).items()} == reference
    assert engine.num_free_pages == engine.num_total_pages


def test_mla_pool_holds_one_latent_head_and_moves_through_prefill_then_decode(deepseek) -> None:
    """The MLA pool is ``[layers, 1, pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]``; a prefill
    engine's latent pages copied into a decode engine continue into transformers' tokens."""
    folder, reference = deepseek
    pre, dec = make_engine(folder, "prefill", chunk_size=8), make_engine(folder, "decode")
    assert pre.kv_pool.shape.kind == "mla" and tuple(pre.kv_cache.shape) == (3, 1, 96, PAGE_SIZE, 1, 16 + 8)
    assert pre.kv_pool.page_bytes == 3 * 1 * PAGE_SIZE * 24 * 4
    dst = {rid: dec.reserve_request(rid, p, greedy()).dst_page_ids for rid, p in PROMPTS.items()}
    for rid, p in PROMPTS.items():
        pre.add_request(rid, p, greedy())
    firsts = {}
    for rid, outs in run(pre).items():
        src = [page for o in outs for page in o.prefill_chunk.page_ids]
        dec.kv_cache[:, :, torch.tensor(dst[rid])] = pre.kv_cache[:, :, torch.tensor(src)]
        pre.release_request(rid)
        firsts[rid] = outs[-1].prefill_chunk
    for rid, chunk in firsts.items():
        dec.add_prebuilt_request(rid, chunk.first_token_id, chunk.first_logprob)
    assert {rid: tokens(o) for rid, o in run(dec).items()} == reference


@pytest.mark.parametrize("overrides", [{"q_lora_rank": None, "rope_interleave": False},
                                       {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}])
def test_deepseek_variants_equal_transformers(tmp_path: Path, overrides: dict) -> None:
    """Plain ``q_proj`` with rotate-half RoPE; ungrouped routing without normalised weights: one prompt
    through the paged KV gives transformers' tokens."""
    reference = reference_tokens(save_model(tmp_path, deepseek_config(**overrides), seed=3),
                                 {"p13": PROMPTS["p13"]})
    engine = make_engine(tmp_path)
    engine.add_request("p13", PROMPTS["p13"], greedy())
    assert tokens(run(engine)["p13"]) == reference["p13"]


def test_routing_ties_break_as_torch_topk_does_in_transformers() -> None:
    """Experts 2, 3 and 6 share one router row (and bias): their scores tie exactly. Our routing picks the
    experts (and weights) transformers' routers pick for every token, including tokens where only some of
    the tied experts fit in the top-k, i.e. where the tie decides."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(5)
    x = torch.randn(64, 64)
    for router, cfg in [(Qwen3MoeTopKRouter(qwen3_moe_config()), _moe(qwen3_moe_config(), "softmax")),
                        (DeepseekV3TopkRouter(deepseek_config()), _moe(deepseek_config(), "sigmoid"))]:
        bias = getattr(router, "e_score_correction_bias", None)
        with torch.no_grad():
            router.weight.normal_(0, 0.1)
            router.weight[3] = router.weight[6] = router.weight[2]
            if bias is not None:
                bias.copy_(torch.randn(8) * 0.05)
                bias[3] = bias[6] = bias[2]
            _, ref_weights, ref_ids = router(x)
        ours = route(torch.nn.functional.linear(x, router.weight), cfg, bias)
        assert torch.equal(ours.topk_ids, ref_ids) and torch.equal(ours.topk_weights, ref_weights)
        chosen = torch.stack([(ref_ids == e).any(dim=1) for e in (2, 3, 6)], dim=1).sum(dim=1)
        assert ((chosen > 0) & (chosen < 2)).any(), "no token where the tie decided"


def test_a_model_whose_router_ties_generates_transformers_tokens(tmp_path: Path) -> None:
    """Qwen3-MoE with experts 1, 4 and 5 tied in every router: greedy tokens equal transformers'."""
    ref = save_model(tmp_path, qwen3_moe_config(), seed=7, tie_gate=(1, 4, 5))
    reference = reference_tokens(ref, {"p29": PROMPTS["p29"]})
    engine = make_engine(tmp_path)
    engine.add_request("p29", PROMPTS["p29"], greedy())
    assert tokens(run(engine)["p29"]) == reference["p29"]


def _moe(hf_config, scoring: str) -> MoEConfig:
    deepseek = scoring == "sigmoid"
    return MoEConfig(num_experts=8, top_k=2, intermediate_size=32, scoring_func=scoring,
                     norm_topk_prob=hf_config.norm_topk_prob,
                     routed_scaling_factor=hf_config.routed_scaling_factor if deepseek else 1.0,
                     n_group=hf_config.n_group if deepseek else 1,
                     topk_group=hf_config.topk_group if deepseek else 1,
                     num_shared_experts=1 if deepseek else 0, sparse_layers=(1, 2), correction_bias=deepseek)


def _bad_folder(tmp_path: Path, **fields) -> Path:
    raw = deepseek_config().to_dict()
    raw.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("fields,named", [
    ({"n_group": 3}, "n_group=3 does not divide the 8 routed experts"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok=3 exceeds the 1 groups"),
    ({"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    ({"n_group": 8, "topk_group": 2}, "n_group=8 leaves 1 expert per group"),
    ({"scoring_func": "sparsemixer"}, "scoring_func 'sparsemixer' is not supported"),
    ({"scoring_func": "softmax", "n_group": 1, "topk_group": 1},
     "scoring_func 'softmax' is not supported for deepseek_v3"),
    ({"num_experts_per_tok": 9, "n_group": 1, "topk_group": 1},
     "num_experts_per_tok=9 exceeds the 8 experts"),
    ({"kv_lora_rank": None}, "missing field 'kv_lora_rank'"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4}}, "rope_type 'dynamic'"),
])
def test_a_config_the_engine_cannot_serve_fails_the_load_naming_the_field(tmp_path: Path, fields: dict,
                                                                          named: str) -> None:
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_model(str(_bad_folder(tmp_path, **fields)))


def test_an_unserved_weight_format_or_tensor_parallel_size_is_refused_by_name(deepseek) -> None:
    folder, _ = deepseek
    with pytest.raises(ValueError, match="weight_quant='int8' is not supported for deepseek_v3"):
        load_model(str(folder), weight_quant="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported for deepseek_v3"):
        load_model(str(folder), tensor_parallel_size=2, rank=0)
