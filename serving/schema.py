"""The response schema: every output a response of this project's models carries, declared once.

``OUTPUTS`` is the table. Each row names one output and says, per layout, its Triton data type and dims (as
the model's ``config.pbtxt`` declares them) and the ``Delta`` attribute it carries:

* the client layout (``CLIENT_MODELS``: ``colocated``, ``pd_ensemble``; Triton's vLLM-backend convention),
  where an output other than ``text_output`` is sent only when the request sets its ``return_*`` input;
* the child layout (``CHILD_MODELS``: ``prefill``, ``decode`` → the router), where text travels as UTF-8 bytes
  in UINT8 tensors (why: ``serving.child.codec.encode_response``) and an output is left out when it holds its
  default (``always`` outputs excepted).

And how the router carries it over the children of one request (``Carry``). What reads the table: the Triton
encoder (``serving.triton.io.response_arrays``), the child codec and its schema hash
(``serving.child.codec``), the router's merge (``serving.router.orchestrator``), the OpenAI front's
request flags and decoder (``frontend.wire``); ``tests/serving/test_response_schema.py`` holds the four
``model_repository/*/config.pbtxt`` to it.

A new count (an int per sample, say) is one row here, one ``Delta`` attribute, its producer and its reader;
the codecs, the merge and the front's decoder follow the row. Standard library only: the front imports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: the models that answer clients (the client layout) and the router's children (the child layout)
CLIENT_MODELS = ("colocated", "pd_ensemble")
CHILD_MODELS = ("prefill", "decode")


class Carry(enum.Enum):
    """How the router's merge carries an output over the children of one request (prefill's first token,
    decode's tokens, a migrated decode's).

    ``CHUNK``: belongs to the response it came in (text, logprobs, token ids, the finish reason, an error);
    ``MAX``: the largest any child reported so far, repeated on every later response (the prompt's length);
    ``PREFILLED``: the largest the child that prefilled the prompt reported (prefill; decode when the router
    sends a request to decode alone), repeated on every later response; ``COUNT``: the router's own running
    count (tokens generated, their cumulative logprob over migrations).
    """

    CHUNK = "chunk"
    MAX = "max"
    PREFILLED = "prefilled"
    COUNT = "count"


@dataclass(frozen=True)
class Layout:
    """How one output travels in one layout.

    Attributes:
        data_type: the Triton data type ``config.pbtxt`` declares (``"TYPE_STRING"``, ``"TYPE_UINT32"``...).
        dims: the declared dims: ``(-1,)`` one entry per sample (client) or a variable length (child),
            ``(1,)`` one value.
        attribute: the ``Delta`` attribute the output carries.
        always: the child layout sends it on every response, even at its default.
    """

    data_type: str
    dims: tuple[int, ...]
    attribute: str
    always: bool = False


@dataclass(frozen=True)
class Output:
    """One row of the schema.

    Attributes:
        name: the output tensor's name.
        client: its client layout; None: child only.
        child: its child layout; None: client only.
        return_flag: the client's ``return_*`` input that asks for it; None: always sent (``text_output``).
        carry: how the router carries it (``Carry``).
    """

    name: str
    client: Layout | None
    child: Layout | None
    return_flag: str | None
    carry: Carry

    @property
    def models(self) -> tuple[str, ...]:
        """The models that send it."""
        return (CLIENT_MODELS if self.client else ()) + (CHILD_MODELS if self.child else ())


def _client(data_type: str, attribute: str, dims: tuple[int, ...] = (-1,)) -> Layout:
    return Layout(data_type, dims, attribute)


def _child(data_type: str, attribute: str, dims: tuple[int, ...] = (-1,), always: bool = False) -> Layout:
    return Layout(data_type, dims, attribute, always)


_TEXT, _BYTES = "TYPE_STRING", "TYPE_UINT8"
#: Every output, in the order the client layout declares them, then the child-only ones.
OUTPUTS: tuple[Output, ...] = (
    Output("text_output", _client(_TEXT, "text"), _child(_BYTES, "text", always=True), None, Carry.CHUNK),
    Output("finish_reason", _client(_TEXT, "finish_reason"), _child(_BYTES, "finish_reason"),
           "return_finish_reason", Carry.CHUNK),
    Output("cumulative_logprob", _client("TYPE_FP32", "cumulative_logprob"),
           _child("TYPE_FP32", "cumulative_logprob", (1,)), "return_cumulative_logprob", Carry.COUNT),
    Output("logprobs", _client(_TEXT, "logprobs"), _child(_BYTES, "logprobs"), "return_logprobs",
           Carry.CHUNK),
    Output("num_input_tokens", _client("TYPE_UINT32", "num_input_tokens", (1,)),
           _child("TYPE_INT32", "num_input_tokens", (1,)), "return_num_input_tokens", Carry.MAX),
    # the client's count is each response's new tokens, the child's the tokens generated so far
    Output("num_output_tokens", _client("TYPE_UINT32", "num_new_tokens"),
           _child("TYPE_INT32", "num_output_tokens", (1,), always=True), "return_num_output_tokens",
           Carry.COUNT),
    # ours (not the vLLM backend's): the prompt tokens the prefix cache of the prefilling instance supplied
    Output("num_cached_tokens", _client("TYPE_UINT32", "num_cached_tokens"),
           _child("TYPE_INT32", "num_cached_tokens", (1,)), "return_num_cached_tokens", Carry.PREFILLED),
    Output("output_token_ids", None, _child("TYPE_INT32", "token_ids"), None, Carry.CHUNK),
    Output("error", None, _child(_BYTES, "error"), None, Carry.CHUNK),
    Output("error_kind", None, _child(_BYTES, "error_kind"), None, Carry.CHUNK),
)
#: the client layout's outputs, by name
CLIENT_OUTPUTS: dict[str, Output] = {o.name: o for o in OUTPUTS if o.client is not None}
#: the child layout's outputs, by name
CHILD_OUTPUTS: dict[str, Output] = {o.name: o for o in OUTPUTS if o.child is not None}
#: the client's ``return_*`` inputs, in declaration order
RETURN_FLAGS: tuple[str, ...] = tuple(o.return_flag for o in OUTPUTS if o.return_flag is not None)
