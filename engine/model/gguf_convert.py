"""Convert a GGUF file (llama.cpp) into a Hugging Face style folder: safetensors + config.json + tokenizer.

The folder is what ``hf_folder`` reads and what transformers' ``from_pretrained`` reads, so the
engine and the reference model see the very same dequantized fp32 weights.

Facts used (GGUF spec, github.com/ggml-org/ggml/blob/master/docs/gguf.md; llama.cpp convert_hf_to_gguf.py):
- tensor names ``blk.N.attn_q.weight`` etc. map one-to-one onto HF names (``_LAYER_NAMES``);
- for the ``llama`` architecture, llama.cpp permutes the rows of Q and K from HF's rotate-half RoPE
  layout into interleaved pairs; ``_unpermute_rows`` undoes it;
- dequantization is the ``gguf`` package's ``quants.dequantize`` (fp32 numpy, rows x cols as in HF).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.gguf_tokenizer import build_gguf_tokenizer
from engine.model.safetensors_io import write_safetensors

logger = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# File order: the tensors the model fuses (q|k|v weights, q|k|v biases, gate|up) sit back to back.
_LAYER_ORDER = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                "self_attn.v_proj.bias",
                "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                "mlp.up_proj.weight", "mlp.down_proj.weight"]


def file_order_key(hf_name: str) -> tuple[int, int]:
    """Sort key of a tensor name in the cache file: embedding, then layer by layer in `_LAYER_ORDER`, then
    the rest."""
    if hf_name == "model.embed_tokens.weight":
        return (-1, 0)
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        return (int(layer), _LAYER_ORDER.index(rest))
    return (1 << 30, 0 if hf_name == "model.norm.weight" else 1)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _read_config(reader: Any, path: Path, model_id: str, has_output: bool) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(str(path), f"unknown GGUF architecture {arch!r} (supported: llama, qwen2)")
    try:
        hidden = int(_field(reader, f"{arch}.embedding_length"))
        heads = int(_field(reader, f"{arch}.attention.head_count"))
        cfg = ModelConfig(
            architecture=arch,
            num_layers=int(_field(reader, f"{arch}.block_count")),
            hidden_size=hidden,
            intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=not has_output,
            attention_bias=arch == "qwen2",
            max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(_field(reader, "tokenizer.ggml.eos_token_id")),),
            model_id=model_id,
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(str(path), f"missing or invalid GGUF metadata: {exc}") from exc
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in {
            t.name for t in reader.tensors}:
        raise ModelLoadError(str(path), "RoPE scaling is not supported")
    return cfg


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pair, half) -> (half, pair). Shapes unchanged."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _dequantized_tensors(reader: Any, path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import quants

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ModelLoadError(str(path), f"unexpected GGUF tensor {t.name!r}")
        w = quants.dequantize(t.data, t.tensor_type)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if cfg.architecture == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute_rows(w, cfg.num_heads)
        elif cfg.architecture == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute_rows(w, cfg.num_kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
    return out


def convert_gguf(path: Path, out_dir: Path, model_id: str) -> ModelConfig:
    """Dequantize ``path`` into ``out_dir`` (``model.safetensors``, ``config.json``, tokenizer files).

    Args:
        path: a GGUF v2/v3 file of architecture ``llama`` or ``qwen2`` with a byte-level BPE (``gpt2``) vocab.
        out_dir: an existing empty folder (the caller renames it into place atomically).
        model_id: recorded in ``config.json`` as ``triton_pd_model_id``.

    Returns:
        The model's ``ModelConfig``. Weights are written as fp32, HF names, Q/K rows un-permuted.

    Raises:
        ModelLoadError: unreadable file, unknown architecture or tokenizer, unexpected tensor.
    """
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct errors/OSError for a bad file
        raise ModelLoadError(str(path), f"not a readable GGUF file: {exc}") from exc
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    cfg = _read_config(reader, path, model_id, has_output)
    tensors = _dequantized_tensors(reader, path, cfg)
    ordered = sorted(tensors.items(), key=lambda kv: file_order_key(kv[0]))
    write_safetensors(out_dir / "model.safetensors", ordered)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    build_gguf_tokenizer(reader, path, cfg, out_dir)
    logger.info("converted %s into %s (%d tensors)", path, out_dir, len(tensors))
    return cfg
