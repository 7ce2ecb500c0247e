"""Text <-> token ids for the engine: a thin wrapper of the ``tokenizers`` library plus the chat template.

The chat template is rendered with jinja2 the way Hugging Face chat templates expect (sandboxed environment,
``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``), so prompts match
``apply_chat_template``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NoReturn

from tokenizers import Tokenizer as _HFTokenizer

from engine.model.errors import ModelLoadError


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(f"chat template error: {message}")


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Byte-level BPE tokenizer with a chat template.

    Attributes:
        eos_token_ids: token ids that end generation (from the model config and the tokenizer config).
        bos_token_id: beginning-of-sequence id, or ``None``.
        vocab_size: number of token ids, added tokens included.
        fingerprint: 16 hex digits of SHA-256 over ``tokenizer.json`` and the chat template: equal
            fingerprints give equal ids for equal prompts (the router forwards its ids to workers whose
            tokenizer has the same fingerprint: ``serving.parsing.pd_request``); ``""`` when not built
            ``from_folder``.
    """

    def __init__(self, backend: _HFTokenizer, chat_template: str | None, eos_token_ids: list[int],
                 bos_token: str | None = None, eos_token: str | None = None, fingerprint: str = "") -> None:
        self._tok = backend
        self._chat_template_src = chat_template
        self._compiled_template: Any = None
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.fingerprint = fingerprint

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        """Read ``tokenizer.json`` and (optional) ``tokenizer_config.json`` / ``chat_template.jinja``.

        Raises:
            ModelLoadError: ``tokenizer.json`` missing or unreadable, naming the file.
        """
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(str(tok_file), "missing tokenizer file")
        try:
            backend = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ModelLoadError(str(tok_file), f"malformed tokenizer: {exc}") from exc
        cfg: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        eos = _token_str(cfg.get("eos_token"))
        ids = list(eos_token_ids or [])
        eos_id = backend.token_to_id(eos) if eos is not None else None
        if eos_id is not None:
            ids.append(eos_id)
        if not ids:
            raise ModelLoadError(str(cfg_file), "no eos token in the model or tokenizer config")
        digest = hashlib.sha256(tok_file.read_bytes() + b"\0" + (template or "").encode("utf-8")).hexdigest()
        return cls(backend, template, ids, _token_str(cfg.get("bos_token")), eos, fingerprint=digest[:16])

    @property
    def backend(self) -> _HFTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (its vocabulary feeds the structured-outputs compiler)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in ``text`` map to their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a multi-byte char cut in two) shows as U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocab string, or ``None``."""
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) into a prompt string with the model's template.

        Raises:
            ValueError: the model has no chat template, or the template rejects the messages.
        """
        if self._chat_template_src is None:
            raise ValueError("this model has no chat template")
        if self._compiled_template is None:
            self._compiled_template = self._compile(self._chat_template_src)
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    @staticmethod
    def _compile(source: str) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, for streaming and stop strings.

    Decodes a short window of recent tokens and emits only new text; when the window ends in U+FFFD (a
    multi-byte UTF-8 character split across tokens) the delta is held back until the character completes.
    The window scheme follows the prefix/read offsets of vLLM's detokenizer (idea only). Cost per push is
    O(window), independent of the sequence length.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be ``""``)."""
        self._ids.append(int(token_id))
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a dangling partial character at the end of generation)."""
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
