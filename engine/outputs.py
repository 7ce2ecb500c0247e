"""What ``LLMEngine.step`` returns: one ``RequestOutput`` per request that progressed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.page_allocator import PageId

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Reservation:
    """Decode mode: where a prefill peer must write a reserved request's prompt KV.

    Attributes:
        dst_page_ids: local pages for the prompt's KV from token ``num_cached_tokens`` on, in order (prompt
            page ``num_cached_tokens // page_size`` first): ``ceil(prompt / page_size) - num_cached_tokens /
            page_size`` pages.
        num_cached_tokens: leading prompt tokens whose KV this engine already holds (its prefix cache; a
            multiple of the page size, below the prompt length, 0 with the cache off): their pages are shared
            with other requests and must never be written.
    """

    dst_page_ids: list[int]
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillChunk:
    """Prefill-mode progress of one request after one chunk.

    Attributes:
        page_ids: pages whose KV this chunk completed, in sequence order. A non-final chunk lists whole pages
            only; the final chunk adds the prompt's partial last page. Over all chunks: the request's first
            ``ceil(num_prompt_tokens / page_size)`` pages, each once.
        is_last: the prompt is fully prefilled; ``first_token_id`` / ``first_logprob`` are set.
        first_token_id: the token sampled after the prompt (final chunk only).
        first_logprob: its logprob under the raw model distribution (final chunk only).
        finish_reason: final chunk only: why the first token already ends the whole request (EOS, a stop token
            or string, ``max_tokens == 1``), else None (decode goes on).
    """

    page_ids: list[PageId]
    is_last: bool
    first_token_id: int | None = None
    first_logprob: float | None = None
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob details of one generated token, for a request with ``SamplingParams.logprobs`` set.

    Attributes:
        token_id: the generated token.
        logprob: its logprob under the raw model distribution.
        rank: its 1-based rank in that distribution (1 = most likely).
        decoded_token: the text this token added to the output (incremental detokenization: ``""`` for a token
            that ends inside a multi-byte character, whose text comes with a later token; the concatenation of
            a request's ``decoded_token``s is its text, up to a stop string cut).
        top: the ``logprobs`` most likely tokens, most likely first: ``(token_id, logprob, text)``, the text
            of each token decoded alone.
    """

    token_id: int
    logprob: float
    rank: int
    decoded_token: str
    top: tuple[tuple[int, float, str], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """Progress of one request in one step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens produced since the previous output (a decode-mode request's first output also
            carries the prefill side's first token).
        new_logprobs: raw-distribution logprob of each new token.
        new_text: text delta since the previous output; a stop string is never part of it, and text that could
            still become a stop string is held back until it cannot.
        finished: no more outputs will come for this request.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` when finished, else None. A prefill-mode
            request finishes with its final chunk (``"stop"`` when the first token already stops it).
        num_prompt_tokens: prompt length in tokens.
        num_output_tokens: tokens generated so far, all outputs together.
        prefill_chunk: prefill mode only: the chunk just computed.
        new_token_logprobs: one per new token when the request asked for logprobs (``SamplingParams.logprobs``
            not None), else empty.
        cumulative_logprob: sum of the raw logprobs of every token generated so far (the first included).
        num_cached_tokens: leading prompt tokens whose KV the prefix cache supplied (not computed here): a
            multiple of the page size, below ``num_prompt_tokens``; 0 with the cache off and in decode mode.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prefill_chunk: PrefillChunk | None = None
    new_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0
