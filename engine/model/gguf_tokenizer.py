"""Build a ``tokenizers`` tokenizer (tokenizer.json + tokenizer_config.json) from a GGUF's embedded vocab.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``, GPT-2 style, Radford et al. 2019) are
supported. The pre-tokenizer follows llama.cpp's ``llama-vocab.cpp`` choice per ``tokenizer.ggml.pre``: for
``smollm`` digits are split one by one before the GPT-2 byte-level regex, as in SmolLM2's own tokenizer.json.
Token types (GGUF spec): 3 = control and 4 = user-defined become added (special / non-special) tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4
_DIGIT_SPLITTING_PRE = {"smollm", "qwen2", "llama3", "llama-bpe", "deepseek-llm"}


def _contents(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _pre_tokenizer(pre: str | None) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _build(reader: Any) -> tuple[Tokenizer, list[str]]:
    tokens: list[str] = list(_contents(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _contents(reader, "tokenizer.ggml.merges", [])]
    types = list(_contents(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_contents(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(t, special=(ty == _CONTROL), normalized=False)
             for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)
    specials = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    return tok, specials


def build_gguf_tokenizer(reader: Any, path: Path, cfg: ModelConfig, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) into ``out_dir``.

    Raises:
        ModelLoadError: the GGUF has no vocab or a tokenizer model other than ``gpt2``.
    """
    kind = _contents(reader, "tokenizer.ggml.model")
    if kind != "gpt2" or _contents(reader, "tokenizer.ggml.tokens") is None:
        raise ModelLoadError(str(path),
                             f"unsupported GGUF tokenizer model {kind!r} (supported: byte-level BPE 'gpt2')")
    tok, specials = _build(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = _contents(reader, "tokenizer.ggml.tokens")
    eos = cfg.eos_token_ids[0]
    bos = cfg.bos_token_id
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos],
        "unk_token": tokens[int(_contents(reader, "tokenizer.ggml.unknown_token_id", 0))],
        "pad_token": tokens[int(_contents(reader, "tokenizer.ggml.padding_token_id", eos))],
        "add_bos_token": bool(_contents(reader, "tokenizer.ggml.add_bos_token", False)),
        "additional_special_tokens": specials,
        "chat_template": _contents(reader, "tokenizer.chat_template"),
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
