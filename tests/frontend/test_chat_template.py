"""The front renders chat messages with the model's own template, so one user message gives exactly the prompt
tokens of the server's ``apply_chat_template=true`` path (``serving.parsing.prompt.prompt_token_ids``), and a
system message and several turns keep their order and roles."""

from __future__ import annotations

import pytest

from frontend.chat import ChatRenderer
from frontend.errors import OpenAIError

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer():  # engine.model.tokenizer.Tokenizer
    from engine.model.loader import load_tokenizer

    return load_tokenizer("smollm2")


def test_one_user_message_gives_the_servers_prompt_tokens(tokenizer) -> None:
    from serving.parsing.prompt import prompt_token_ids
    from serving.parsing.request import GenerateRequest

    for text in ("What is the capital of France?", "  spaces and\nnewlines  ", "ünïcödé ✓"):
        rendered = ChatRenderer(tokenizer).render([{"role": "user", "content": text}])
        server = prompt_token_ids(tokenizer, GenerateRequest(prompt=text, apply_chat_template=True))
        assert tokenizer.encode(rendered) == server


def test_system_and_turns_are_rendered_in_order(tokenizer) -> None:
    rendered = ChatRenderer(tokenizer).render([
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of Italy?"}])
    order = [rendered.index(s) for s in ("You are terse.", "Hi", "Hello!", "Capital of Italy?")]
    assert order == sorted(order) and rendered.endswith("<|im_start|>assistant\n")
    assert "SmolLM" not in rendered   # the given system message replaces the template's default one


def test_a_template_that_rejects_the_messages_is_a_400_on_messages() -> None:
    class Rejecting:
        def apply_chat_template(self, messages: list[dict[str, str]],
                                add_generation_prompt: bool = True) -> str:
            raise ValueError("chat template error: roles must alternate")

    with pytest.raises(OpenAIError) as e:
        ChatRenderer(Rejecting()).render([{"role": "user", "content": "x"}])
    assert e.value.status == 400 and e.value.param == "messages" and "alternate" in e.value.message
