"""Parse one generation request in the Triton LLM convention (what Triton's vLLM backend accepts).

Inputs, as ``triton_io.read_inputs`` hands them over (one Python scalar per input; absent inputs are missing):

============================  =======  ==========================================================
``text_input``                bytes    the prompt, UTF-8, required, non-empty
``stream``                    bool     one response per text delta (default false)
``sampling_parameters``       bytes    JSON object: max_tokens, temperature, top_p, top_k, seed, stop,
                                       stop_token_ids, ignore_eos; values may be strings (``"32"``,
                                       ``"true"``) as genai-perf sends them
``exclude_input_in_output``   bool     non-streaming: default false, the prompt is prepended to
                                       ``text_output``; streaming: the prompt is never sent, and an explicit
                                       false is an error (as in the vLLM backend)
``apply_chat_template``       bool     wrap the prompt as one user message in the model's chat template
============================  =======  ==========================================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParams
from engine.sampling import SamplingParams

RawValue = bytes | str | bool
INPUT_NAMES: tuple[str, ...] = (
    "text_input", "stream", "sampling_parameters", "exclude_input_in_output", "apply_chat_template")
_BOOL_INPUTS: tuple[str, ...] = ("stream", "exclude_input_in_output", "apply_chat_template")


class RequestError(ValueError):
    """A request input is missing its constraint; the request gets an error response, nothing else does.

    Attributes:
        field: the input (``"text_input"``) or sampling parameter (``"sampling_parameters.max_tokens"``).
        reason: what is wrong with it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"invalid input {field!r}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed, validated generation request.

    Attributes:
        prompt: the text the client sent (before any chat template).
        stream: send one response per new text delta instead of one response at the end.
        params: the engine's sampling parameters.
        exclude_input_in_output: do not prepend the prompt to the (non-streaming) output.
        apply_chat_template: wrap ``prompt`` as a user message in the model's chat template.
    """

    prompt: str
    stream: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    exclude_input_in_output: bool = False
    apply_chat_template: bool = False

    @property
    def echo_prompt(self) -> bool:
        """True when the prompt is prepended to the output text (non-streaming without exclusion)."""
        return not self.stream and not self.exclude_input_in_output


def parse_request(inputs: Mapping[str, RawValue]) -> GenerateRequest:
    """Validate the inputs of one request and build its ``GenerateRequest``.

    Args:
        inputs: input name → scalar value; absent optional inputs are simply missing.
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
        raise RequestError("exclude_input_in_output", "must be true (or absent) when streaming: "
                           "a streamed response never repeats the prompt")
    params = parse_sampling_parameters(inputs.get("sampling_parameters"))
    return GenerateRequest(prompt=prompt, stream=stream, params=params,
                           exclude_input_in_output=stream if exclude is None else exclude,
                           apply_chat_template=flags.get("apply_chat_template", False))


def parse_sampling_parameters(raw: RawValue | None) -> SamplingParams:
    """Parse the ``sampling_parameters`` JSON object; None or an empty string give the defaults.

    Raises:
        RequestError: ``sampling_parameters`` for malformed JSON or a non-object,
            ``sampling_parameters.<key>`` for an unknown key or a bad value.
    """
    if raw is None:
        return SamplingParams()
    text = _text("sampling_parameters", raw).strip()
    if not text:
        return SamplingParams()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError("sampling_parameters", f"malformed JSON: {e}") from None
    if not isinstance(values, dict):
        raise RequestError("sampling_parameters", f"must be a JSON object, got {type(values).__name__}")
    try:
        return SamplingParams.from_dict(values)
    except InvalidSamplingParams as e:
        raise RequestError(f"sampling_parameters.{e.param}", e.reason) from None


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
