"""Chat messages → one prompt string, rendered with the served model's own chat template.

The tokenizer is loaded the way the router loads it (``engine.model.loader.load_tokenizer``: the same files
the workers read), and ``Tokenizer.apply_chat_template`` is the very function the server applies for
``apply_chat_template=true``, so one user message renders to the same prompt tokens either way.
"""

from __future__ import annotations

from typing import Protocol

from frontend.errors import bad_request


class ChatTemplate(Protocol):
    """What the renderer needs of a tokenizer (``engine.model.tokenizer.Tokenizer`` is one)."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt of ``messages``. Raises ValueError when there is no template or it rejects them."""
        ...


class ChatRenderer:
    """Renders chat requests; called on the front's event loop (rendering is pure CPU, ~0.1 ms)."""

    def __init__(self, template: ChatTemplate) -> None:
        self._template = template

    @classmethod
    def load(cls, tokenizer: str) -> ChatRenderer:
        """The renderer of ``tokenizer`` (``smollm2``, a ``.gguf`` path or a Hugging Face folder, as the
        engine's ``load_model``). Raises ``engine.model.errors.ModelLoadError`` when it cannot be read."""
        from engine.model.loader import load_tokenizer

        return cls(load_tokenizer(tokenizer))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text, generation prompt appended. Raises OpenAIError (400, ``messages``) when the
        template rejects the messages (e.g. roles out of order) or the model has none."""
        try:
            return self._template.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise bad_request(f"cannot render the messages with the model's chat template: {e}",
                              "messages") from None
