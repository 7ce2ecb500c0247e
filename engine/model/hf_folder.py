"""Read a Hugging Face model folder: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

Field names follow transformers' ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` (and
``DeepseekV3Config`` / ``Qwen3MoeConfig``: ``engine.model.moe_config``); both the older
``rope_theta`` / ``rope_scaling`` and the newer ``rope_parameters`` dict are understood, with the RoPE
scalings ``linear``, ``llama3`` and ``yarn`` (``engine.model.rope_scaling``); ``dynamic``, ``longrope`` and
any other ``rope_type`` fail the load, named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.moe_config import moe_fields
from engine.model.rope_scaling import rope_fields
from engine.model.safetensors_io import read_safetensors_file


def _architecture(raw: dict[str, Any], path: Path) -> str:
    arch = str(raw.get("model_type", "")).lower()
    if arch not in SUPPORTED_ARCHITECTURES:
        names = raw.get("architectures") or [arch]
        raise ModelLoadError(str(path),
                             f"unknown architecture {names} (supported: {SUPPORTED_ARCHITECTURES})")
    return arch


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def read_hf_config(path: Path, model_id: str) -> ModelConfig:
    """Parse ``path`` (a ``config.json``) into a ``ModelConfig``.

    Raises:
        ModelLoadError: missing/unparsable file, unknown architecture, missing field, unsupported feature.
    """
    if not path.is_file():
        raise ModelLoadError(str(path), "missing config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(str(path), f"malformed JSON: {exc}") from exc
    arch = _architecture(raw, path)
    if arch == "llama" and raw.get("attention_bias"):
        raise ModelLoadError(str(path), "Llama attention_bias (o_proj bias) is not supported")
    max_pos = int(raw.get("max_position_embeddings", 4096))
    if arch == "mistral" and raw.get("sliding_window"):
        max_pos = min(max_pos, int(raw["sliding_window"]))  # full attention is exact up to the window
    try:
        heads = int(raw["num_attention_heads"])
        fields: dict[str, Any] = dict(
            architecture=arch, num_layers=int(raw["num_hidden_layers"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            vocab_size=int(raw["vocab_size"]), **rope_fields(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2", max_position_embeddings=max_pos,
            bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_ids(raw),
            model_id=str(raw.get("triton_pd_model_id", model_id)),
        )
        fields.update(moe_fields(arch, raw))   # MoE / MLA architectures: their own fields, named on error
        return ModelConfig(**fields)
    except KeyError as exc:
        raise ModelLoadError(str(path), f"missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(str(path), f"invalid config: {exc}") from exc


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in ``folder`` (CPU, original dtype, views of one buffer
    per file).

    Raises:
        ModelLoadError: no safetensors file, an unreadable one, or a tensor name found in two files.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(folder), "missing weights: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        part = read_safetensors_file(f)
        dup = tensors.keys() & part.keys()
        if dup:
            raise ModelLoadError(str(f), f"tensor {sorted(dup)[0]!r} also present in another file")
        tensors.update(part)
    return tensors
