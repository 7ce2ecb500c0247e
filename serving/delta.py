"""The delta type of the serving path: what one sample's stream says in one step (``Delta``), whose fault a
failure is (``ErrorKind``), one response's payload (``ResponseChunk``) and the merge of two of a stream's
responses (``merge_chunks``). Shared by the workers, the child protocol, the router and the Triton glue, so it
sits at the bottom of ``serving/``: it imports nothing of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from engine.outputs import TokenLogprob


class ErrorKind(enum.Enum):
    """Whose fault a failed request is; travels with the error to the router (the child output
    ``error_kind``), which decides by it alone (never by the message) whether another instance should try.

    ``REQUEST``: the request itself (a bad input or sampling parameter, a prompt the engine rejects, a prompt
    the tokenizer cannot take): every instance would answer the same, so it is neither retried nor counted
    against the instance's circuit breaker (a client sending bad requests must not take healthy instances out
    of rotation). ``INSTANCE``: this instance could not serve it (its KV transfer failed or timed out, its
    peer died, it is stopping, an engine fault): another instance may succeed.

    ``UNREACHABLE``: the router's own finding, never on the wire: the child could not be reached or its stream
    broke (the only kind that counts against the instance's circuit breaker).
    """

    REQUEST = "request"
    INSTANCE = "instance"
    UNREACHABLE = "unreachable"

    @classmethod
    def from_wire(cls, value: str) -> ErrorKind:
        """The kind a child sent: ``REQUEST`` or ``INSTANCE``; ``INSTANCE`` for an empty or unknown value (a
        retry is the safe default; a child never claims ``UNREACHABLE``)."""
        return cls.REQUEST if value == cls.REQUEST.value else cls.INSTANCE


@dataclass(frozen=True, kw_only=True)
class Delta:
    """What one sample's stream says in one step: the one delta type of the serving path. The same value is a
    response's sample (``ResponseChunk.samples``), a child response as the router reads it
    (``serving.child.codec.decode_raw_response``) and what the router's orchestrator hands its responder; only
    the engine's own ``RequestOutput`` comes before it (``GenerationStream`` turns that into deltas).

    Attributes:
        text: new text (a delta when streaming; the whole text in a non-streaming response; ``""`` when the
            sample has nothing new).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once the sample ended, else None.
        num_input_tokens: prompt length in tokens, after the chat template (0 when not known yet).
        num_output_tokens: tokens the sample generated so far, the first included.
        num_new_tokens: tokens generated since the previous response (the vLLM backend's ``num_output_tokens``
            output; set on responses to the client).
        cumulative_logprob: sum of the raw logprobs of the sample's tokens so far.
        logprobs: one entry per new token when the request asked for logprobs, else None.
        num_cached_tokens: leading prompt tokens whose KV the prefix cache of the instance that prefilled
            supplied (their prefill was skipped); 0 until known.
        token_ids: ids of the new tokens, in order (for the router to resume the request elsewhere).
        num_migrations: times the router moved the sample's decode to another instance so far (set by the
            router on what it sends the client; 0 elsewhere).
        error: the request failed with this message (a terminal delta: ``final`` is set).
        error_kind: whose fault ``error`` is (``ErrorKind``).
        final: the last delta of its stream (a child's FINAL flag; the sample's last chunk in the router).
    """

    text: str = ""
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_new_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: tuple[TokenLogprob, ...] | None = None
    num_cached_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    num_migrations: int = 0
    error: str | None = None
    error_kind: ErrorKind = ErrorKind.INSTANCE
    final: bool = False

    @classmethod
    def failure(cls, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> Delta:
        """The terminal delta of a failed stream."""
        return cls(error=message, error_kind=kind, final=True)


@dataclass(frozen=True)
class ResponseChunk:
    """The payload of one response: one ``Delta`` per sample (index = sample index). ``text``,
    ``finish_reason`` and ``num_output_tokens`` read sample 0 (``n == 1``, the common case).

    Attributes:
        samples: ``n`` entries.
    """

    samples: tuple[Delta, ...]

    @classmethod
    def single(cls, *, text: str = "", finish_reason: str | None = None, num_input_tokens: int = 0,
               num_output_tokens: int = 0, num_new_tokens: int = 0, cumulative_logprob: float = 0.0,
               logprobs: tuple[TokenLogprob, ...] | None = None, num_cached_tokens: int = 0,
               token_ids: tuple[int, ...] = ()) -> ResponseChunk:
        """A response of a one-sample request."""
        return cls((Delta(text=text, finish_reason=finish_reason, num_input_tokens=num_input_tokens,
                          num_output_tokens=num_output_tokens, num_new_tokens=num_new_tokens,
                          cumulative_logprob=cumulative_logprob, logprobs=logprobs,
                          num_cached_tokens=num_cached_tokens, token_ids=token_ids),))

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason

    @property
    def num_output_tokens(self) -> int:
        return self.samples[0].num_output_tokens

    @property
    def num_input_tokens(self) -> int:
        """The prompt's length in tokens: the samples share one prompt (0 while none knows it)."""
        return max((s.num_input_tokens for s in self.samples), default=0)


def merge_chunks(earlier: ResponseChunk, later: ResponseChunk) -> ResponseChunk:
    """One streaming response saying what ``earlier`` then ``later`` (two consecutive, non-final-then-any
    responses of one stream) say: per sample, the texts, new tokens, their logprobs and ids joined in order;
    the counts and the cumulative logprob of ``later``; the finish reason of ``later``, else ``earlier``'s (a
    prefill's first token carries the finish reason when it already ends the request, and its final response,
    sent once the KV is written, carries none: merged, the pair must still say why the request ended).

    Used by ``ResponseDispatcher`` to send a stream that fell behind as fewer responses (vLLM's and SGLang's
    ``stream_interval`` idea, driven by the backlog instead of a fixed interval).

    Raises:
        ValueError: the two chunks have different sample counts.
    """
    if len(earlier.samples) != len(later.samples):
        raise ValueError(f"cannot merge chunks of {len(earlier.samples)} and {len(later.samples)} samples")
    samples = []
    for a, b in zip(earlier.samples, later.samples):
        logprobs = None if a.logprobs is None and b.logprobs is None \
            else (a.logprobs or ()) + (b.logprobs or ())
        samples.append(replace(b, text=a.text + b.text, finish_reason=b.finish_reason or a.finish_reason,
                               num_input_tokens=b.num_input_tokens or a.num_input_tokens,
                               num_new_tokens=a.num_new_tokens + b.num_new_tokens, logprobs=logprobs,
                               num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
                               token_ids=a.token_ids + b.token_ids))
    return ResponseChunk(tuple(samples))
