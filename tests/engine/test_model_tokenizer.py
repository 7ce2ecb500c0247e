"""The SmolLM2 tokenizer built from the GGUF: round trips text, renders the chat template like transformers,
and the incremental detokenizer streams exactly the full decode, holding back split multi-byte characters.
"""

from __future__ import annotations

import pytest

from engine.model import IncrementalDetokenizer, LoadedModel

pytestmark = pytest.mark.model

TEXTS = ["Hello, world!", "The year 2024 had 366 days.", "naïve café — 東京 🚀🎉 ok", "  spaces\n\ttabs  "]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(smollm2: LoadedModel, text: str) -> None:
    """decode(encode(text)) == text for ASCII, digits, accents, CJK, emoji and whitespace."""
    tok = smollm2.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_eos(smollm2: LoadedModel) -> None:
    """<|im_end|> is one special token, the eos; decode skips it unless asked to keep it."""
    tok = smollm2.tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")] == [2]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.vocab_size == smollm2.config.vocab_size == 49152


def test_digits_split_one_by_one(smollm2: LoadedModel) -> None:
    """SmolLM2's pre-tokenizer splits numbers into single digits (one token per digit)."""
    tok = smollm2.tokenizer
    assert [tok.decode([i]) for i in tok.encode("12345")] == ["1", "2", "3", "4", "5"]


def test_chat_template_renders_system_default(smollm2: LoadedModel) -> None:
    """The GGUF's template adds SmolLM2's default system turn and an assistant generation prompt."""
    prompt = smollm2.tokenizer.apply_chat_template(MESSAGES)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert not smollm2.tokenizer.apply_chat_template(MESSAGES,
                                                     add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.reference
def test_chat_template_and_ids_match_transformers(smollm2: LoadedModel) -> None:
    """Prompt string and its ids equal transformers' tokenizer read from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    from engine.model.loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = smollm2.tokenizer.apply_chat_template(MESSAGES)
    assert prompt == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    text = "naïve café — 東京 🚀 Lighthouses guided ships, then lamps."
    assert smollm2.tokenizer.encode(prompt + text) == ref.encode(prompt + text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + ["🚀" * 5 + "x", "東京タワー"])
def test_incremental_detokenizer_streams_full_text(smollm2: LoadedModel, text: str) -> None:
    """Concatenated deltas equal decode(ids); no delta ever contains U+FFFD (split characters are held
    back)."""
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text == detok.text


def test_incremental_detokenizer_skips_special_tokens(smollm2: LoadedModel) -> None:
    """An eos pushed at the end adds no text."""
    tok = smollm2.tokenizer
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in tok.encode("Paris.") + [2])
    assert text == "Paris."


def test_the_fingerprint_covers_the_vocabulary_and_the_chat_template(smollm2: LoadedModel, tmp_path) -> None:
    """Equal files, equal fingerprint (the router's ids are the workers'); another chat template, another
    one."""
    import shutil

    from engine.model.loader import _resolve_folder, default_cache_root, load_tokenizer
    from engine.model.tokenizer import Tokenizer

    ours = load_tokenizer("smollm2")
    assert len(ours.fingerprint) == 16 and ours.fingerprint == smollm2.tokenizer.fingerprint
    folder = tmp_path / "tok"
    folder.mkdir()
    source = _resolve_folder("smollm2", default_cache_root())
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        '{"eos_token": "<|im_end|>", "chat_template": "{{ messages }}"}')
    other = Tokenizer.from_folder(folder)
    assert other.fingerprint != ours.fingerprint and other.encode("Hello there") == ours.encode("Hello there")
