"""A request's prompt as token ids: what the colocated worker, a PD worker's intake and the router (for its
cache-aware pairing and the ids it hands both children) each do with one request's prompt."""

from __future__ import annotations

from typing import Protocol

from serving.parsing.request import GenerateRequest


class Tokenizer(Protocol):
    """The part of ``engine.tokenizer.Tokenizer`` the worker uses."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


def prompt_token_ids(tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """The prompt's token ids, after wrapping it as one user message when ``apply_chat_template`` is set."""
    text = request.prompt
    if request.apply_chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)
