"""The Triton LLM-convention wire contract the front speaks (the vLLM backend's), as typed values; pure.

Inputs (``request_arrays``): ``text_input`` BYTES [1]; ``stream`` BOOL [1] (always true: the front aggregates
non-streaming answers itself); ``exclude_input_in_output`` BOOL [1] (true); ``sampling_parameters`` BYTES [1]
(a JSON object); and, only where the model declares them (``Contract``), the ``return_*`` inputs of
``serving.schema``: ``return_logprobs`` and ``return_cumulative_logprob`` when the request wants logprobs,
every other one (``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``,
``return_num_cached_tokens``...) always.

Outputs of one response (``ResponseDecoder``), entry ``i`` of each belonging to sample (choice) ``i``:
``text_output`` BYTES [n] (text delta), ``finish_reason`` BYTES [n] (``"None"`` or ``""`` until the sample
ends), ``logprobs`` BYTES [n] (a JSON list, one ``{"<id>": {"logprob", "rank", "decoded_token"}}`` per new
token, the sampled token first, then its top-k; ``"null"`` when not asked), ``num_input_tokens`` [1],
``num_output_tokens`` [n], and every other per-sample count of the schema (UINT32 [n], in
``SampleDelta.counts`` by output name): ``num_cached_tokens`` (the sample's prompt tokens the server's prefix
cache supplied; the same on each of its responses, 0 in a sample's entry until that sample reported). Models
that declare ``return_num_output_tokens`` send new tokens per response; older ones (no ``return_*`` inputs)
send one sample and cumulative INT32 counts, turned into deltas here. An absent output means "not asked" and
decodes as empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from serving.schema import CLIENT_OUTPUTS, RETURN_FLAGS

JSONValue = str | int | float | bool | list[str] | list[int] | dict[str, float]
#: Outputs the front may read; absent ones are simply not in a response.
OUTPUT_NAMES: tuple[str, ...] = tuple(CLIENT_OUTPUTS)
_LOGPROB_FLAGS = ("return_logprobs", "return_cumulative_logprob")
_ALWAYS_ASKED = tuple(flag for flag in RETURN_FLAGS if flag not in _LOGPROB_FLAGS)
#: the per-sample counts a response may carry besides ``num_output_tokens`` (``SampleDelta.counts``)
COUNT_NAMES: tuple[str, ...] = tuple(
    o.name for o in CLIENT_OUTPUTS.values()
    if o.client is not None and o.client.data_type == "TYPE_UINT32" and o.client.dims == (-1,)
    and o.name != "num_output_tokens")


@dataclass(frozen=True)
class Contract:
    """What the served model declares, read once from its metadata (``get_model_metadata``).

    Attributes:
        input_names: the model's declared inputs.
    """

    input_names: frozenset[str]

    @property
    def counts_per_response(self) -> bool:
        """True: ``num_output_tokens`` holds each response's new tokens; False: cumulative (older servers)."""
        return "return_num_output_tokens" in self.input_names

    def flags(self, want_logprobs: bool) -> tuple[str, ...]:
        """The ``return_*`` inputs to set true for a request, among those the model declares."""
        wanted = _ALWAYS_ASKED + (_LOGPROB_FLAGS if want_logprobs else ())
        return tuple(name for name in wanted if name in self.input_names)


@dataclass(frozen=True)
class BackendRequest:
    """One generation request to the Triton model.

    Attributes:
        request_id: the front's id (``cmpl-...``), sent as Triton's request id.
        prompt: the text sent as ``text_input`` (a chat request's rendered template).
        sampling: the ``sampling_parameters`` keys to send (only those the client set, plus max_tokens and
            temperature); values JSON-encodable.
        want_logprobs: ask for the ``logprobs`` and ``cumulative_logprob`` outputs.
    """

    request_id: str
    prompt: str
    sampling: Mapping[str, JSONValue]
    want_logprobs: bool = False

    @property
    def n(self) -> int:
        value = self.sampling.get("n", 1)
        return value if isinstance(value, int) else 1


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log probability (natural log) and its top alternatives, best first."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class SampleDelta:
    """What one response carries for sample ``index``.

    Attributes:
        index: the sample (choice) index, 0..n-1.
        text: new text (may be empty).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` on the sample's last response, else None.
        num_new_tokens: tokens this response added to the sample.
        logprobs: one entry per new token (empty when not asked).
        counts: the sample's counts of ``COUNT_NAMES`` the response carried, by output name
            (``num_cached_tokens``: its prompt tokens served by the prefix cache); a count not sent is absent.
    """

    index: int
    text: str = ""
    finish_reason: str | None = None
    num_new_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def num_cached_tokens(self) -> int | None:
        return self.counts.get("num_cached_tokens")


@dataclass(frozen=True)
class BackendResponse:
    """One response of the stream: a delta per sample (empty for an empty FINAL response)."""

    samples: tuple[SampleDelta, ...] = ()
    num_input_tokens: int | None = None
    final: bool = False


def request_arrays(request: BackendRequest, contract: Contract) -> dict[str, np.ndarray]:
    """The request's input arrays by name, each of shape [1] (BYTES as object arrays, BOOL as np.bool_)."""
    arrays = {
        "text_input": np.array([request.prompt.encode("utf-8")], dtype=np.object_),
        "stream": np.array([True], dtype=np.bool_),
        "exclude_input_in_output": np.array([True], dtype=np.bool_),
        "sampling_parameters": np.array([json.dumps(dict(request.sampling)).encode("utf-8")],
                                        dtype=np.object_),
    }
    for name in contract.flags(request.want_logprobs):
        arrays[name] = np.array([True], dtype=np.bool_)
    return arrays


class ResponseDecoder:
    """Turns one request's raw responses, in order, into ``BackendResponse`` values; one per request."""

    def __init__(self, contract: Contract) -> None:
        self._per_response = contract.counts_per_response
        self._cumulative: dict[int, int] = {}   # older servers: sample → tokens counted so far

    def decode(self, values: Mapping[str, np.ndarray], final: bool) -> BackendResponse:
        """``values``: the response's output arrays (absent outputs left out); ``final``: its FINAL flag."""
        texts = _strings(values.get("text_output"))
        if not texts:
            return BackendResponse(final=final)
        reasons = _strings(values.get("finish_reason"))
        counts = _ints(values.get("num_output_tokens"))
        logprobs = _strings(values.get("logprobs"))
        others = {name: _ints(values.get(name)) for name in COUNT_NAMES}
        samples = []
        for i, text in enumerate(texts):
            reason = reasons[i] if i < len(reasons) else ""
            samples.append(SampleDelta(
                index=i, text=text, finish_reason=None if reason in ("", "None") else reason,
                num_new_tokens=self._new_tokens(i, counts[i] if i < len(counts) else 0),
                logprobs=parse_logprobs(logprobs[i]) if i < len(logprobs) else (),
                counts={name: got[i] for name, got in others.items() if i < len(got)}))
        inputs = _ints(values.get("num_input_tokens"))
        return BackendResponse(tuple(samples), inputs[0] if inputs else None, final)

    def _new_tokens(self, index: int, count: int) -> int:
        if self._per_response:
            return count
        before = self._cumulative.get(index, 0)
        self._cumulative[index] = max(before, count)
        return max(0, count - before)


def parse_logprobs(raw: str) -> tuple[TokenLogprob, ...]:
    """One ``logprobs`` entry (a JSON list of ``{"<id>": {"logprob", "rank", "decoded_token"}}``, the sampled
    token first) → one ``TokenLogprob`` per token; ``"null"``/``""`` → (). Raises ValueError on malformed
    JSON."""
    if raw in ("", "null", "None"):
        return ()
    entries = json.loads(raw)
    if entries is None:
        return ()
    tokens = []
    for entry in entries:
        items = list(entry.items())
        if not items:
            continue
        sampled_id, sampled = items[0]
        ranked = sorted(items, key=lambda kv: int(kv[1].get("rank") or 1 << 30))
        top = tuple((str(v.get("decoded_token", "")), float(v["logprob"])) for _, v in ranked
                    if v.get("rank") is not None)
        tokens.append(TokenLogprob(int(sampled_id), str(sampled.get("decoded_token", "")),
                                   float(sampled["logprob"]), top))
    return tuple(tokens)


def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    flat = np.asarray(array, dtype=np.object_).reshape(-1)
    return [item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item) for item in flat]


def _ints(array: np.ndarray | None) -> list[int]:
    return [] if array is None else [int(x) for x in np.asarray(array).reshape(-1)]


@dataclass
class SampleTotals:
    """What one sample accumulated over the stream (used by the non-streaming answer and usage)."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


class Totals:
    """Accumulates a request's responses: per-sample text, finish reason, tokens, logprobs and counts (the
    largest each sample reported); prompt tokens."""

    def __init__(self, n: int) -> None:
        self.samples: list[SampleTotals] = [SampleTotals() for _ in range(n)]
        self.num_input_tokens = 0

    def add(self, response: BackendResponse) -> None:
        if response.num_input_tokens is not None:
            self.num_input_tokens = response.num_input_tokens
        for delta in response.samples:
            if delta.index >= len(self.samples):
                self.samples.extend(SampleTotals() for _ in range(delta.index + 1 - len(self.samples)))
            sample = self.samples[delta.index]
            sample.text.append(delta.text)
            sample.num_tokens += delta.num_new_tokens
            sample.logprobs.extend(delta.logprobs)
            for name, count in delta.counts.items():
                sample.counts[name] = max(sample.counts.get(name, 0), count)
            if delta.finish_reason is not None:
                sample.finish_reason = delta.finish_reason

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def prompt_count(self, name: str) -> int | None:
        """A count of the prompt (``COUNT_NAMES``: ``num_cached_tokens``, the prompt's tokens served by the
        server's prefix cache), counted once like the prompt: the least of the samples' (each sample is its
        own prefill, and a later one may reuse an earlier one's pages); None when the server sent no
        ``name``."""
        counts = [s.counts[name] for s in self.samples if name in s.counts]
        return min(counts) if counts else None

    @property
    def num_cached_tokens(self) -> int | None:
        return self.prompt_count("num_cached_tokens")

