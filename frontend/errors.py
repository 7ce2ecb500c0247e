"""Errors of the front, each with its HTTP status and OpenAI error body; Triton error messages mapped to them.

Triton errors arrive as text on the gRPC stream (the server's ``RequestError`` and router messages):

=====================================================  ======  ========================  ===================
message                                                status  type                      param
=====================================================  ======  ========================  ===================
``invalid input 'sampling_parameters.<key>': ...``     400     ``invalid_request_error`` ``<key>`` (OpenAI's
                                                                                         name where it
                                                                                         differs)
``invalid input '...structured_outputs.<kind>': ...``  400     ``invalid_request_error`` the field the front
                                                                                         made it from
``invalid input '<input>': ...``                       400     ``invalid_request_error`` prompt / messages
``request rejected: ...`` (too long, ...)              400     ``invalid_request_error`` None
``server busy: ...``                                   429     ``rate_limit_error``      None
``no healthy ... instance ...``, unreachable server    503     ``service_unavailable``   None
anything else                                          500     ``internal_error``        None
=====================================================  ======  ========================  ===================

The message of an ``invalid input`` error names the OpenAI field instead of the server's input
(``invalid input 'top_k': ...``, ``invalid input 'response_format': ...``): the client never sent
``sampling_parameters``.
"""

from __future__ import annotations

import re

from frontend.protocol import ErrorBody, ErrorInfo

_INVALID_INPUT = re.compile(r"invalid input '([^']+)': (.*)", re.DOTALL)
#: Triton input names → the OpenAI field the client sent.
_INPUT_TO_FIELD = {"text_input": "prompt", "sampling_parameters.logprobs": "logprobs"}
#: The server's name of what the front sends for response_format and forced tool calls.
_CONSTRAINT_INPUT = "sampling_parameters.structured_outputs"


class OpenAIError(Exception):
    """A request that fails with ``status`` and OpenAI's error body; raised anywhere in a request's handling.

    Attributes:
        status: HTTP status (400, 404, 429, 500, 503).
        message: what went wrong, for the client.
        type: OpenAI's error type (``invalid_request_error``, ...).
        param: the request field at fault, if one is.
        code: a machine-readable code (``model_not_found``, ...), if any.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                         code=self.code))


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def unsupported(field: str, detail: str = "") -> OpenAIError:
    """400 for an OpenAI field this server cannot honour, naming it."""
    suffix = f": {detail}" if detail else ""
    return OpenAIError(400, f"'{field}' is not supported by this server{suffix}", "invalid_request_error",
                       field)


def from_triton_message(message: str, prompt_field: str = "prompt",
                        constraint_field: str = "response_format") -> OpenAIError:
    """The ``OpenAIError`` of one Triton error message (table in the module docstring).

    Args:
        message: the error text of the stream (``InferenceServerException.message()``).
        prompt_field: the OpenAI field that became ``text_input`` (``prompt`` or ``messages``).
        constraint_field: the OpenAI field that became ``structured_outputs`` (``response_format`` or
            ``tools``).
    """
    found = _INVALID_INPUT.search(message)
    if found:
        name = found.group(1)
        if name == "text_input":
            param = prompt_field
        elif name == _CONSTRAINT_INPUT or name.startswith(_CONSTRAINT_INPUT + "."):
            param = constraint_field
        else:
            param = _INPUT_TO_FIELD.get(name, name.removeprefix("sampling_parameters."))
        return OpenAIError(400, message.replace(f"'{name}'", f"'{param}'", 1), "invalid_request_error", param)
    lowered = message.lower()
    if "server busy" in lowered:
        return OpenAIError(429, message, "rate_limit_error", code="server_busy")
    if "no healthy" in lowered or "unavailable" in lowered or "unreachable" in lowered:
        return OpenAIError(503, message, "service_unavailable")
    if "rejected:" in lowered:
        return OpenAIError(400, message, "invalid_request_error")
    return OpenAIError(500, message, "internal_error")
