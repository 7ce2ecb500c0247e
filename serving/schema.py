"""The response schema: every output a response of this project's models carries, declared once.

``OUTPUTS`` is the table. Each row names one output, says what it holds (its documentation) and, per layout,
its Triton data type and dims (as the model's config declares them) and the ``Delta`` attribute it carries:

* the client layout (``CLIENT_MODELS``: ``colocated``, ``pd_ensemble``; Triton's vLLM-backend convention),
  where an output other than ``text_output`` is sent only when the request sets its ``return_*`` input;
* the child layout (``CHILD_MODELS``: ``prefill``, ``decode`` → the router), where text travels as UTF-8 bytes
  in UINT8 tensors (why: ``serving.child.codec.encode_response``) and an output is left out when it holds its
  default (``always`` outputs excepted).

And how the router carries it over the children of one request (``Carry``). What reads the table: the models'
configs (no ``config.pbtxt`` declares an output or a ``return_*`` input: each ``model.py`` adds its role's,
``config_outputs`` and ``config_inputs``, in the python backend's ``auto_complete_config``:
``serving.triton.entry``), the Triton encoder (``serving.triton.io.response_arrays``), the child codec and
its schema hash (``serving.child.codec``), the router's merge (``serving.router.orchestrator``), the OpenAI
front's request flags and decoder (``frontend.wire``), the perf tools' request flags
(``scripts/perf/make_inputs.py``); ``tests/serving/test_response_schema.py`` holds the models' auto-complete
to it.

A new count (an int per sample, say) is one row here, one ``Delta`` attribute, its producer and its reader;
the configs, the codecs, the merge, the front's decoder and the perf inputs follow the row. Standard library
only: the front and the auto-complete stub import it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
        data_type: the Triton data type the model's config declares (``"TYPE_STRING"``, ``"TYPE_UINT32"``...).
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
        description: what it holds: the output's documentation (README points here).
    """

    name: str
    client: Layout | None
    child: Layout | None
    return_flag: str | None
    carry: Carry
    description: str = ""

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
    Output("text_output", _client(_TEXT, "text"), _child(_BYTES, "text", always=True), None, Carry.CHUNK,
           "the sample's new text (streaming), or its whole text; always sent"),
    Output("finish_reason", _client(_TEXT, "finish_reason"), _child(_BYTES, "finish_reason"),
           "return_finish_reason", Carry.CHUNK,
           '"None" until the sample ends, then "stop" (EOS, a stop string or token), "length" or "abort"'),
    Output("cumulative_logprob", _client("TYPE_FP32", "cumulative_logprob"),
           _child("TYPE_FP32", "cumulative_logprob", (1,)), "return_cumulative_logprob", Carry.COUNT,
           "the sum of the raw logprobs of the sample's tokens so far"),
    Output("logprobs", _client(_TEXT, "logprobs"), _child(_BYTES, "logprobs"), "return_logprobs",
           Carry.CHUNK,
           'JSON: one {"<token id>": {"logprob", "rank", "decoded_token"}} per token of this response, the '
           'sampled token first, then the top `logprobs`; "null" without the `logprobs` sampling parameter '
           "(child: serving.child.codec.logprobs_to_wire, empty when not asked)"),
    Output("num_input_tokens", _client("TYPE_UINT32", "num_input_tokens", (1,)),
           _child("TYPE_INT32", "num_input_tokens", (1,)), "return_num_input_tokens", Carry.MAX,
           "the prompt's length in tokens, after the chat template"),
    # the client's count is each response's new tokens, the child's the tokens generated so far
    Output("num_output_tokens", _client("TYPE_UINT32", "num_new_tokens"),
           _child("TYPE_INT32", "num_output_tokens", (1,), always=True), "return_num_output_tokens",
           Carry.COUNT, "the sample's tokens in this response (child: generated so far)"),
    # ours (not the vLLM backend's): the prompt tokens the prefix cache of the prefilling instance supplied
    Output("num_cached_tokens", _client("TYPE_UINT32", "num_cached_tokens"),
           _child("TYPE_INT32", "num_cached_tokens", (1,)), "return_num_cached_tokens", Carry.PREFILLED,
           "the sample's prompt tokens whose KV the prefix cache supplied (their prefill skipped): whole "
           "pages, below the prompt length, 0 on a miss; on pd_ensemble the prefill instance's hit"),
    # ours: the router's own count, set on what it sends the client (colocated and the children send 0)
    Output("num_migrations", _client("TYPE_UINT32", "num_migrations"), None, "return_num_migrations",
           Carry.COUNT,
           "times pd_ensemble moved the sample's decode to another decode instance mid-stream (the instance "
           "failed, went silent or drained), resuming it from the tokens already sent: so far, on every "
           "response; 0 on colocated"),
    Output("output_token_ids", None, _child("TYPE_INT32", "token_ids"), None, Carry.CHUNK,
           "ids of the tokens generated since the previous response (prefill: the first token): what the "
           "router resumes a request with on another decode instance when this one fails mid-stream"),
    Output("error", None, _child(_BYTES, "error"), None, Carry.CHUNK,
           "set on the last response when the request failed (an error response would never end "
           "pd_ensemble's BLS response iterator in tritonserver 2.51)"),
    Output("error_kind", None, _child(_BYTES, "error_kind"), None, Carry.CHUNK,
           'whose fault the error is: "request" (never retried) or "instance" (serving.delta.ErrorKind)'),
)
#: the client layout's outputs, by name
CLIENT_OUTPUTS: dict[str, Output] = {o.name: o for o in OUTPUTS if o.client is not None}
#: the child layout's outputs, by name
CHILD_OUTPUTS: dict[str, Output] = {o.name: o for o in OUTPUTS if o.child is not None}
#: the client's ``return_*`` inputs, in declaration order
RETURN_FLAGS: tuple[str, ...] = tuple(o.return_flag for o in OUTPUTS if o.return_flag is not None)

#: one entry of a model config's ``input`` or ``output`` section, as Triton's model config JSON writes it
#: (``{"name", "data_type", "dims"}``, inputs also ``"optional"``)
ConfigEntry = dict[str, Any]


def layout_of(role: str) -> str:
    """``"client"`` for a model of ``CLIENT_MODELS``, ``"child"`` for one of ``CHILD_MODELS`` (``role`` is the
    model's kind, not its name: a copy named ``prefill_1`` or ``pd_ensemble_rr`` has the role of its
    ``model.py``). Raises ValueError for another role."""
    if role in CLIENT_MODELS:
        return "client"
    if role in CHILD_MODELS:
        return "child"
    raise ValueError(f"unknown model role {role!r}: one of {CLIENT_MODELS + CHILD_MODELS}")


def config_outputs(role: str) -> list[ConfigEntry]:
    """The ``output`` section a model of ``role`` declares: every output of its layout, in ``OUTPUTS`` order.
    What the model's ``auto_complete_config`` adds (``serving.triton.entry``); its ``config.pbtxt`` leaves
    them out. Raises ValueError for an unknown role."""
    client = layout_of(role) == "client"
    entries = []
    for output in OUTPUTS:
        layout = output.client if client else output.child
        if layout is not None:
            entries.append({"name": output.name, "data_type": layout.data_type, "dims": list(layout.dims)})
    return entries


def config_inputs(role: str) -> list[ConfigEntry]:
    """The inputs of a model of ``role`` that the schema declares: a client model's ``return_*`` flags
    (optional ``BOOL [1]``); none for a child. Its ``config.pbtxt`` declares the other inputs. Raises
    ValueError for an unknown role."""
    if layout_of(role) == "child":
        return []
    return [{"name": flag, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for flag in RETURN_FLAGS]


def undeclared(model_config: Mapping[str, Any], role: str) -> list[str]:
    """The names of the schema's inputs and outputs for ``role`` (``config_inputs``, ``config_outputs``) that
    ``model_config`` (Triton's model config as JSON: a model's ``args["model_config"]``) lacks or declares
    with another data type or dims; [] when it has them all."""
    missing = []
    for section, entries in (("input", config_inputs(role)), ("output", config_outputs(role))):
        have = {e.get("name"): e for e in model_config.get(section, [])}
        for entry in entries:
            got = have.get(entry["name"])
            if got is None or got.get("data_type") != entry["data_type"] \
                    or [int(d) for d in got.get("dims", [])] != entry["dims"]:
                missing.append(entry["name"])
    return missing


def config_pbtxt(role: str) -> str:
    """``config_inputs`` and ``config_outputs`` of ``role`` as ``config.pbtxt`` text (an ``input`` and an
    ``output`` list; protobuf's text format appends a repeated field's later lists to the earlier ones), for a
    launcher that writes complete configs into its own repository copy and then starts tritonserver with
    ``--disable-auto-complete-config`` (``scripts/perf/server.py``; ``scripts/serve.sh`` passes that flag when
    every config of its repository declares an ``output`` list). Raises ValueError for an unknown role."""

    def entry(e: ConfigEntry) -> str:
        optional = ", optional: true" if e.get("optional") else ""
        dims = ", ".join(str(d) for d in e["dims"])
        return f'  {{ name: "{e["name"]}", data_type: {e["data_type"]}, dims: [ {dims} ]{optional} }}'

    text = ""
    for section, entries in (("input", config_inputs(role)), ("output", config_outputs(role))):
        if entries:
            text += f"{section} [\n" + ",\n".join(entry(e) for e in entries) + "\n]\n"
    return text
