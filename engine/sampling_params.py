"""Sampling parameters of one request and their parsing from loosely typed dicts (the ``sampling_parameters``
of Triton's vLLM backend convention, OpenAI requests).

The parameters and their meaning follow vLLM's ``SamplingParams`` (names, ranges, defaults), so that those
requests map onto them one to one. What the sampler does with them: ``engine.sampler``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.errors import InvalidSamplingParams
from engine.structured.spec import SPEC_KEYS, StructuredSpec, parse_structured

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")

#: Most top logprobs per token a request may ask for (vLLM's default ``max_logprobs``; OpenAI allows 20).
MAX_LOGPROBS = 20
#: Most samples per request (``n``); each is a full request in the engine.
MAX_N = 16
#: Largest ``seed``: what a torch generator takes (an unsigned 64-bit integer).
MAX_SEED = 2**64 - 1
#: Bound of one ``logit_bias`` value (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
#: vLLM sampling keys this engine accepts only at their default value (the value they have here anyway).
ACCEPTED_AT_DEFAULT: dict[str, object] = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "detokenize": True, "best_of": 1,
    "use_beam_search": False,
}
#: vLLM sampling keys this engine does not implement: a request naming one is refused with this reason.
UNSUPPORTED: dict[str, str] = {
    "guided_json": "OpenAI-server extra field: use structured_outputs.json",
    "guided_regex": "OpenAI-server extra field: use structured_outputs.regex",
    "guided_choice": "OpenAI-server extra field: use structured_outputs.choice",
    "guided_grammar": "OpenAI-server extra field: use structured_outputs.grammar",
    "response_format": "OpenAI-server field: use structured_outputs.json or structured_outputs.json_object",
    "lora_name": "LoRA adapters are not supported",
    "lora_request": "LoRA adapters are not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
    "bad_words": "bad_words is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "logits_processors": "custom logits processors are not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported",
    "length_penalty": "beam search is not supported",
    "early_stopping": "beam search is not supported",
}


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request and when to stop.

    Attributes:
        max_tokens: most new tokens to generate (>= 1); reaching it finishes with ``"length"``.
        temperature: >= 0; 0 means greedy (argmax).
        top_k: keep the k most likely tokens; -1 (or 0) disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        seed: seeds this request's own generator, making its tokens independent of the batch; None uses the
            engine's generator.
        stop: strings that finish the request (``"stop"``); the matched string is cut from the output text.
            Stored as a tuple.
        stop_token_ids: token ids that finish the request (``"stop"``); stored as a tuple.
        ignore_eos: keep generating past the tokenizer's EOS tokens.
        logprobs: None: no logprobs reported; k >= 0: report the chosen token's logprob and rank and the k
            most likely tokens' (``0 <= k <= MAX_LOGPROBS``).
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already generated.
        frequency_penalty: in [-2, 2]; times the token's count so far, subtracted from its logit.
        repetition_penalty: > 0 (1 disables); applied to every token of the prompt and of the output.
        min_p: in [0, 1]; sampling keeps tokens whose probability is at least ``min_p`` times the top one's.
        min_tokens: no EOS, stop token or stop string ends the request before this many tokens
            (``<= max_tokens``).
        include_stop_str_in_output: keep the matched stop string (or a ``stop_token_ids`` token's text) in the
            output text.
        n: samples of the prompt (``1 <= n <= MAX_N``); the serving layer expands a request into ``n`` engine
            requests (``for_sample``), the engine itself runs ``n == 1`` only.
        logit_bias: ``(token_id, bias)`` pairs added to the logits (bias in [-100, 100]); given as a mapping
            ``{token_id: bias}`` (ids may be strings, as in JSON), stored sorted as a tuple.
        structured: the output's constraint (JSON schema, JSON object, regex, choice, grammar), or None; given
            on the wire as vLLM's ``structured_outputs`` (or ``guided_decoding``) object.

    Raises:
        InvalidSamplingParams: naming the first parameter whose value is out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", _parse_logit_bias("logit_bias", self.logit_bias))
        else:
            object.__setattr__(self, "logit_bias", tuple(sorted(tuple(pair) for pair in self.logit_bias)))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self._validate()

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """True when logits are changed before the choice (bias, min_tokens or a penalty is set)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n``-sample request: ``n == 1`` and, when seeded,
        ``seed + index`` (vLLM's parallel sampling does the same), so each sample is reproducible."""
        seed = None if self.seed is None else (self.seed + index) % (2**63)
        return replace(self, n=1, seed=seed)

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidSamplingParams("temperature", f"must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed > MAX_SEED:
                raise InvalidSamplingParams("seed", f"must be <= {MAX_SEED} (64 bits), got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams("stop", f"must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParams("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise InvalidSamplingParams("logprobs", f"must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidSamplingParams(name, f"must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidSamplingParams("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams("min_tokens", f"must be <= max_tokens ({self.max_tokens}), "
                                                      f"got {self.min_tokens}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidSamplingParams("include_stop_str_in_output",
                                        f"must be a bool, got {self.include_stop_str_in_output!r}")
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise InvalidSamplingParams("n", f"must be <= {MAX_N}, got {self.n}")
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias", token_id, minimum=0)
            _check_float("logit_bias", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParams(
                    "logit_bias", f"bias of token {token_id} must be in "
                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict such as Triton's ``sampling_parameters`` JSON.

        Numbers and bools may arrive as strings (genai-perf sends ``{"max_tokens": "32"}``); ``stop`` may be
        one string or a list; ``None`` values mean "default".

        Raises:
            InvalidSamplingParams: an unknown key, a key this engine does not implement (``UNSUPPORTED``, or
                one of ``ACCEPTED_AT_DEFAULT`` at another value), a value of the wrong type, or out of range.
        """
        known = {f.name for f in fields(cls)} - {"structured"}
        kwargs: dict[str, Any] = {}
        specs = [k for k in SPEC_KEYS if d.get(k) is not None]
        if len(specs) > 1:
            raise InvalidSamplingParams(specs[1], f"give one of {list(SPEC_KEYS)}, not both")
        for key, value in d.items():
            if key in SPEC_KEYS:
                if value is not None:
                    kwargs["structured"] = parse_structured(key, value)
                continue
            if key in UNSUPPORTED:
                if value is None:
                    continue
                raise InvalidSamplingParams(key, f"not supported by this server: {UNSUPPORTED[key]}")
            if key in ACCEPTED_AT_DEFAULT:
                default = ACCEPTED_AT_DEFAULT[key]
                parse = _parse_bool if isinstance(default, bool) else _parse_int
                if value is not None and parse(key, value) != default:
                    raise InvalidSamplingParams(key, f"not supported by this server except at {default!r}")
                continue
            if key not in known:
                raise InvalidSamplingParams(key,
                                            f"unknown parameter (known: {sorted(known | set(SPEC_KEYS))})")
            if value is not None:
                kwargs[key] = _PARSERS[key](key, value)
        return cls(**kwargs)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSamplingParams(name, f"must be an int, got {value!r}")
    if value < minimum:
        raise InvalidSamplingParams(name, f"must be >= {minimum}, got {value}")


def _check_float(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidSamplingParams(name, f"must be a finite number, got {value!r}")


def _parse_int(name: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise InvalidSamplingParams(name, f"must be an int, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSamplingParams(name, f"must be an int, got {value!r}")
    return value


def _parse_float(name: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise InvalidSamplingParams(name, f"must be a number, got {value!r}") from None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidSamplingParams(name, f"must be a number, got {value!r}")
    return float(value)


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise InvalidSamplingParams(name, f"must be a bool, got {value!r}")


def _parse_stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidSamplingParams(name, f"must be a string or a list of strings, got {value!r}")


def _parse_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidSamplingParams(name, f"must be a list of ints, got {value!r}")
    return tuple(_parse_int(name, v) for v in value)


def _parse_logit_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, Mapping):
        raise InvalidSamplingParams(name, f"must be an object of token id -> bias, got {value!r}")
    return tuple(sorted((_parse_int(name, k), _parse_float(name, v)) for k, v in value.items()))


_PARSERS = {
    "max_tokens": _parse_int, "temperature": _parse_float, "top_k": _parse_int, "top_p": _parse_float,
    "seed": _parse_int, "stop": _parse_stop, "stop_token_ids": _parse_token_ids, "ignore_eos": _parse_bool,
    "logprobs": _parse_int, "presence_penalty": _parse_float, "frequency_penalty": _parse_float,
    "repetition_penalty": _parse_float, "min_p": _parse_float, "min_tokens": _parse_int,
    "include_stop_str_in_output": _parse_bool, "n": _parse_int, "logit_bias": _parse_logit_bias,
}
