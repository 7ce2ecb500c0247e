"""A tiny random DeepSeek-V3 (MLA, 8 routed experts, top-2, one shared expert, one dense layer first) made
with transformers' own ``DeepseekV3Config`` and saved with ``save_pretrained``, with a whitespace word-level
tokenizer over ``t0`` .. ``t127``: the MoE model the expert-parallel benchmark runs (the engine tests build
the same shapes). Needs transformers; init std 0.1 so that every head and expert matters, a non-zero
``e_score_correction_bias`` (transformers starts it at zeros).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
#: DeepseekV3Config fields of the tiny model (transformers' names)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             initializer_range=0.1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def build_tiny_deepseek_v3(dest: Path, seed: int = 0) -> Path:
    """Write the model into ``dest`` (created) and return it. Raises ImportError without transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**SHAPE))
    with torch.no_grad():
        for layer in model.model.layers[SHAPE["first_k_dense_replace"]:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape) * 0.1)
    model.save_pretrained(dest)
    tokenizer = Tokenizer(models.WordLevel({f"t{k}": k for k in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    return dest


def main() -> None:
    """``tiny_moe.py DEST``: write the tiny DeepSeek-V3 into ``DEST`` (a folder ``load_model`` and the
    ``model`` parameter take)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("dest", type=Path, help="folder to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_deepseek_v3(args.dest, args.seed))


if __name__ == "__main__":
    main()
