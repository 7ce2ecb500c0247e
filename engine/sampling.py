"""Sampling parameters of one request, their parsing from loosely typed dicts, and the batch sampler.

Logprobs: the reported logprob of a chosen token is taken from the *raw* model distribution,
``log_softmax(logits)`` before temperature, top-k and top-p (vLLM's default), so greedy and sampled requests
report comparable numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from engine.errors import InvalidSamplingParams

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self._validate()

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

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
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams("stop", f"must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParams("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a wire dict such as Triton's ``sampling_parameters`` JSON.

        Numbers and bools may arrive as strings (genai-perf sends ``{"max_tokens": "32"}``); ``stop`` may be
        one string or a list; ``None`` values mean "default".

        Raises:
            InvalidSamplingParams: an unknown key, a value of the wrong type, or a value out of range.
        """
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise InvalidSamplingParams(key, f"unknown parameter (known: {sorted(known)})")
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


_PARSERS = {
    "max_tokens": _parse_int, "temperature": _parse_float, "top_k": _parse_int, "top_p": _parse_float,
    "seed": _parse_int, "stop": _parse_stop, "stop_token_ids": _parse_token_ids, "ignore_eos": _parse_bool,
}


@dataclass(frozen=True)
class SampleResult:
    """Chosen token and its raw-distribution logprob, one entry per logits row."""

    token_ids: list[int]
    logprobs: list[float]


class Sampler:
    """Picks one token per logits row; greedy rows are argmax'ed together, the others one row at a time.

    Each non-greedy row draws from its own ``torch.Generator`` (exponential-race sampling, ``vocab_size``
    draws per token), so a seeded request yields the same tokens whatever else shares its batch.
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator]) -> SampleResult:
        """Sample.

        Args:
            logits: ``[num_rows, vocab_size]`` float32, raw model output.
            params: one per row.
            generators: one per row, on ``logits.device``; used by non-greedy rows only.
        Returns:
            ``SampleResult`` with ``num_rows`` tokens and logprobs.
        """
        logits = logits.float()
        token_ids = torch.argmax(logits, dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                token_ids[i] = _sample_row(logits[i], p, generators[i])
        chosen = torch.gather(logits, 1, token_ids[:, None]).squeeze(1)
        logprobs = chosen - torch.logsumexp(logits, dim=-1)
        return SampleResult(token_ids.tolist(), logprobs.tolist())


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token from ``logits`` ``[vocab_size]`` under temperature, top-k and top-p."""
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_vals, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_vals, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))
