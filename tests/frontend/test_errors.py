"""Triton error messages → OpenAI status, type and param (the table in frontend/errors.py)."""

from __future__ import annotations

import re

import pytest

from frontend.errors import from_triton_message


@pytest.mark.parametrize(("message", "status", "type_", "param"), [
    ("invalid input 'sampling_parameters.max_tokens': must be >= 1, got 0", 400, "invalid_request_error",
     "max_tokens"),
    ("invalid input 'sampling_parameters.logprobs': unknown parameter (known: [...])", 400,
     "invalid_request_error",
     "logprobs"),
    ("invalid input 'text_input': must not be empty", 400, "invalid_request_error", "prompt"),
    ("request 'x' rejected: needs 2000 pages, the pool has 1024", 400, "invalid_request_error", None),
    ("request rejected: prompt of 9000 tokens exceeds max_model_len 8192", 400,
     "invalid_request_error", None),
    ("server busy: 256 requests in flight and 512 queued; retry later", 429, "rate_limit_error", None),
    ("no healthy prefill instance in the fleet", 503, "service_unavailable", None),
    ("decode decode@127.0.0.1:8001 unreachable: UNAVAILABLE", 503, "service_unavailable", None),
    ("something odd", 500, "internal_error", None),
])
def test_triton_messages_map_to_a_fitting_status(message: str, status: int, type_: str,
                                                 param: str | None) -> None:
    error = from_triton_message(message)
    assert (error.status, error.type, error.param) == (status, type_, param)
    body = error.body().model_dump()
    shown = message if param is None else re.sub(r"'[^']+'", f"'{param}'", message, count=1)
    assert body == {"error": {"message": shown, "type": type_, "param": param, "code": error.code}}
    assert not any(name in body["error"]["message"] for name in ("sampling_parameters", "text_input"))


def test_the_prompt_field_is_named_as_the_client_sent_it() -> None:
    error = from_triton_message("invalid input 'text_input': x", prompt_field="messages")
    assert (error.param, error.message) == ("messages", "invalid input 'messages': x")


@pytest.mark.parametrize("field", ["response_format", "tools"])
def test_a_structured_outputs_error_names_the_field_the_front_made_it_from(field: str) -> None:
    for kind in ("json", "json_object"):
        message = f"invalid input 'sampling_parameters.structured_outputs.{kind}': cannot be compiled: oops"
        error = from_triton_message(message, "messages", field)
        assert (error.status, error.param) == (400, field)
        assert error.message == f"invalid input '{field}': cannot be compiled: oops"
