"""Parse one generation request in the Triton LLM convention (what Triton's vLLM backend accepts).

Inputs, as ``triton_io.read_inputs`` hands them over (one Python scalar per input; absent inputs are missing):

============================  =======  ==========================================================
``text_input``                bytes    the prompt, UTF-8, required, non-empty
``stream``                    bool     one response per text delta (default false)
``sampling_parameters``       bytes    JSON object: max_tokens, temperature, top_p, top_k, seed, stop,
                                       stop_token_ids, ignore_eos, ..., and vLLM's ``structured_outputs``
                                       (or ``guided_decoding``) object (``engine.structured.spec``); values
                                       may be strings (``"32"``, ``"true"``) as genai-perf sends them
``exclude_input_in_output``   bool     non-streaming: default false, the prompt is prepended to
                                       ``text_output``; streaming: the prompt is never sent, and an explicit
                                       false is an error (as in the vLLM backend)
``apply_chat_template``       bool     wrap the prompt as one user message in the model's chat template
``return_<output>``           bool     send ``<output>``: one flag per optional output of the client
                                       layout (``serving.schema.RETURN_FLAGS``; what each output holds:
                                       its row of ``serving.schema.OUTPUTS``)
============================  =======  ==========================================================

Without a ``sampling_parameters`` input, the request's Triton parameters are the sampling parameters (what the
extra JSON fields of HTTP ``generate`` / ``generate_stream`` become, and what ``tritonclient``'s
``parameters=`` sends), as in the vLLM backend; keys starting with ``triton_`` are Triton's own and skipped.
The ``return_*`` inputs and the outputs they enable follow the vLLM backend's ``docs/additional_outputs.md``;
the outputs that backend does not have (``num_cached_tokens``, ...) are ours and follow the same rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParams
from engine.sampling_params import SamplingParams
from serving.schema import CLIENT_OUTPUTS, RETURN_FLAGS

RawValue = bytes | str | bool
#: the ``return_*`` inputs, one per optional output of the client layout (``serving.schema``)
RETURN_INPUTS: tuple[str, ...] = RETURN_FLAGS
INPUT_NAMES: tuple[str, ...] = (
    "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "apply_chat_template",
    *RETURN_INPUTS)
_BOOL_INPUTS: tuple[str, ...] = ("stream", "exclude_input_in_output", "apply_chat_template", *RETURN_INPUTS)
#: The vLLM backend's own words for this error (its client tests compare the message).
STREAM_PROMPT_ERROR = ("Error generating stream: When streaming, `exclude_input_in_output` = False is not "
                       "allowed.")


class RequestError(ValueError):
    """A request input is missing its constraint; the request gets an error response, nothing else does.

    Attributes:
        field: the input (``"text_input"``) or sampling parameter (``"sampling_parameters.max_tokens"``).
        reason: what is wrong with it.
    """

    def __init__(self, field: str, reason: str, message: str | None = None) -> None:
        """``message`` replaces the default text ``invalid input '<field>': <reason>``."""
        super().__init__(message or f"invalid input {field!r}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class OutputOptions:
    """Which optional outputs the client asked for (their ``return_*`` inputs), by output name; none by
    default.

    Attributes:
        names: the outputs asked for (names of ``serving.schema.CLIENT_OUTPUTS``).
    """

    names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, *names: str) -> OutputOptions:
        return cls(frozenset(names))

    def asks(self, name: str) -> bool:
        """True when the output ``name`` is sent: asked for, or one without a ``return_*`` input."""
        return name in self.names or CLIENT_OUTPUTS[name].return_flag is None


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed, validated generation request.

    Attributes:
        prompt: the text the client sent (before any chat template).
        stream: send one response per new text delta instead of one response at the end.
        params: the engine's sampling parameters.
        exclude_input_in_output: do not prepend the prompt to the (non-streaming) output.
        apply_chat_template: wrap ``prompt`` as a user message in the model's chat template.
        outputs: the optional outputs asked for.
        sampling: the sampling parameters as the client sent them (JSON object; the router forwards them,
            per sample, to prefill and decode).
    """

    prompt: str
    stream: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    exclude_input_in_output: bool = False
    apply_chat_template: bool = False
    outputs: OutputOptions = field(default_factory=OutputOptions)
    sampling: Mapping[str, object] = field(default_factory=dict)

    @property
    def echo_prompt(self) -> bool:
        """True when the prompt is prepended to the output text (non-streaming without exclusion)."""
        return not self.stream and not self.exclude_input_in_output


def parse_request(inputs: Mapping[str, RawValue],
                  parameters: Mapping[str, object] | None = None) -> GenerateRequest:
    """Validate the inputs of one request and build its ``GenerateRequest``.

    Args:
        inputs: input name → scalar value; absent optional inputs are simply missing.
        parameters: the request's Triton parameters (``pb_utils.InferenceRequest.parameters()`` parsed);
            the sampling parameters when there is no ``sampling_parameters`` input.
    Raises:
        RequestError: naming the first offending input (unknown input, missing or empty prompt, invalid UTF-8,
            malformed JSON, unknown sampling parameter, wrong type, value out of range, streaming with
            ``exclude_input_in_output=false``).
    """
    for name in inputs:
        if name not in INPUT_NAMES:
            raise RequestError(name, f"unknown input (known: {list(INPUT_NAMES)})")
    if "text_input" not in inputs:
        raise RequestError("text_input", "is required")
    prompt = _text("text_input", inputs["text_input"])
    if not prompt:
        raise RequestError("text_input", "must not be empty")
    flags = {name: _bool(name, inputs[name]) for name in _BOOL_INPUTS if name in inputs}
    stream = flags.get("stream", False)
    exclude = flags.get("exclude_input_in_output")
    if stream and exclude is False:
        raise RequestError("exclude_input_in_output", STREAM_PROMPT_ERROR, message=STREAM_PROMPT_ERROR)
    if "sampling_parameters" in inputs:
        sampling = sampling_dict(inputs["sampling_parameters"])
    else:
        sampling = {k: v for k, v in (parameters or {}).items() if not k.startswith("triton_")}
    params = sampling_params(sampling)
    outputs = OutputOptions(frozenset(o.name for o in CLIENT_OUTPUTS.values()
                                      if o.return_flag is not None and flags.get(o.return_flag, False)))
    return GenerateRequest(prompt=prompt, stream=stream, params=params,
                           exclude_input_in_output=stream if exclude is None else exclude,
                           apply_chat_template=flags.get("apply_chat_template", False), outputs=outputs,
                           sampling=sampling)


def sampling_dict(raw: RawValue | None) -> dict[str, object]:
    """The ``sampling_parameters`` JSON object as a dict; None or an empty string give ``{}``.

    Raises:
        RequestError: ``sampling_parameters`` for malformed JSON or a non-object.
    """
    if raw is None:
        return {}
    text = _text("sampling_parameters", raw).strip()
    if not text:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError("sampling_parameters", f"malformed JSON: {e}") from None
    if not isinstance(values, dict):
        raise RequestError("sampling_parameters", f"must be a JSON object, got {type(values).__name__}")
    return values


def sampling_params(values: Mapping[str, object]) -> SamplingParams:
    """``SamplingParams`` of a sampling dict.

    Raises:
        RequestError: ``sampling_parameters.<key>`` for an unknown or unsupported key or a bad value.
    """
    try:
        return SamplingParams.from_dict(dict(values))
    except InvalidSamplingParams as e:
        raise RequestError(f"sampling_parameters.{e.param}", e.reason) from None


def parse_sampling_parameters(raw: RawValue | None) -> SamplingParams:
    """Parse the ``sampling_parameters`` JSON object; None or an empty string give the defaults.

    Raises:
        RequestError: as ``sampling_dict`` and ``sampling_params``.
    """
    return sampling_params(sampling_dict(raw))


def sample_sampling(sampling: Mapping[str, object], params: SamplingParams, index: int) -> dict[str, object]:
    """The sampling dict of sample ``index`` of an ``n``-sample request (``n`` 1, seed ``seed + index``), as
    ``SamplingParams.for_sample`` gives it: what the router forwards to the children of that sample."""
    values = {k: v for k, v in sampling.items() if k != "n"}
    sample = params.for_sample(index)
    if sample.seed is not None:
        values["seed"] = sample.seed
    return values


def _text(name: str, value: RawValue) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(name, f"is not valid UTF-8: {e}") from None
    if isinstance(value, str):
        return value
    raise RequestError(name, f"must be a string, got {type(value).__name__}")


def _bool(name: str, value: RawValue) -> bool:
    if isinstance(value, bool):
        return value
    raise RequestError(name, f"must be a bool, got {type(value).__name__}")
