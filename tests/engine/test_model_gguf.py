"""GGUF conversion on small synthetic files (fp32 tensors, written with the ``gguf`` package): llama.cpp's Q/K
row permutation is undone exactly (MHA and GQA), Qwen2 keeps its q/k/v biases unpermuted, tied and untied
heads
are recognised, the vocab becomes a working byte-level BPE tokenizer, and the cache is written once,
atomically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.model import ModelLoadError, load_model

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 16, 4, 2, 24, 2
HEAD_DIM = HIDDEN // HEADS
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "abc", "Ġa"]
TYPES = [3, 3, 3, 1, 1, 1, 1, 1, 1, 1]
MERGES = ["a b", "ab c", "Ġ a"]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


def _write_gguf(path: Path, arch: str, tied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Write a tiny model; return its tensors under HF names, in HF (unpermuted) layout."""
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer)
    hf: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, *shape: int, permute_heads: int = 0) -> None:
        w = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name] = w
        stored = _llama_cpp_permute(w, permute_heads) if permute_heads and arch == "llama" else w
        writer.add_tensor(gguf_name, stored)

    add("token_embd.weight", "model.embed_tokens.weight", len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight", HIDDEN)
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", HIDDEN, HIDDEN, permute_heads=HEADS)
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN,
            permute_heads=KV_HEADS)
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        if arch == "qwen2":
            add(b + "attn_q.bias", p + "self_attn.q_proj.bias", HIDDEN)
            add(b + "attn_k.bias", p + "self_attn.k_proj.bias", KV_HEADS * HEAD_DIM)
            add(b + "attn_v.bias", p + "self_attn.v_proj.bias", KV_HEADS * HEAD_DIM)
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", HIDDEN, HIDDEN)
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", HIDDEN)
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", FFN, HIDDEN)
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", FFN, HIDDEN)
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", HIDDEN, FFN)
    add("output_norm.weight", "model.norm.weight", HIDDEN)
    if not tied:
        add("output.weight", "lm_head.weight", len(TOKENS), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_gguf_weights_come_back_in_hf_layout(tmp_path: Path, arch: str, tied: bool) -> None:
    """Every fused parameter equals the concatenation of the original HF tensors (Q/K un-permuted)."""
    hf = _write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tied, np.random.default_rng(0))
    loaded = load_model(str(tmp_path / f"tiny-{arch}.gguf"), cache_dir=tmp_path / "cache")
    cfg = loaded.config
    assert (cfg.architecture, cfg.tie_word_embeddings, cfg.attention_bias) == (arch, tied, arch == "qwen2")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (HEADS, KV_HEADS, HEAD_DIM, 10)
    assert cfg.model_id == f"tiny-{arch}" and cfg.eos_token_ids == (2,)
    layer, p = loaded.model.layers[1], "model.layers.1."
    qkv = np.concatenate([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(layer.qkv_proj, torch.from_numpy(qkv))
    if arch == "qwen2":
        bias = np.concatenate([hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        assert layer.qkv_bias is not None and torch.equal(layer.qkv_bias, torch.from_numpy(bias))
    gate_up = np.concatenate([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    assert torch.equal(layer.gate_up_proj, torch.from_numpy(gate_up))
    head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
    assert torch.equal(loaded.model.lm_head, torch.from_numpy(head))


def test_gguf_tokenizer_and_template(tmp_path: Path) -> None:
    """The embedded vocab encodes with its merges, knows its special tokens and renders the chat template."""
    _write_gguf(tmp_path / "tiny.gguf", "llama", True, np.random.default_rng(1))
    tok = load_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache").tokenizer
    assert tok.encode("abc a") == [TOKENS.index("abc"), TOKENS.index("Ġa")]
    assert tok.encode("<|im_start|>ab") == [1, TOKENS.index("ab")]
    assert tok.decode([1, 8, 2]) == "abc" and tok.eos_token_ids == [2]
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "<|im_start|>ab<|im_end|>"


def test_gguf_cache_written_once(tmp_path: Path) -> None:
    """A second load reuses the cache (same file, untouched); a killed run's leftover temp dir is ignored."""
    _write_gguf(tmp_path / "tiny.gguf", "llama", True, np.random.default_rng(2))
    cache = tmp_path / "cache"
    (cache / ".tiny.tmp-killed").mkdir(parents=True)  # what a killed conversion leaves behind
    first = load_model(str(tmp_path / "tiny.gguf"), cache_dir=cache)
    weights = first.folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    second = load_model(str(tmp_path / "tiny.gguf"), cache_dir=cache)
    assert second.folder == first.folder == cache / "tiny" and weights.stat().st_mtime_ns == stamp
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def test_gguf_with_unknown_architecture_is_refused(tmp_path: Path) -> None:
    """A GGUF of another architecture names the file and the architecture; no cache folder appears."""
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"x\.gguf: unknown GGUF architecture 'falcon'"):
        load_model(str(tmp_path / "x.gguf"), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "x").exists()
