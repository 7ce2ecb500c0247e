"""One client stream: engine events of a request → the responses the Triton LLM convention promises.

``GenerationStream`` turns the ``LoopEvent``s of one request into ``ResponseChunk``s on a ``ResponseSink``:

* streaming: one response per non-empty text delta (the instance's response thread merges those of a stream
  that fell behind: ``merge_chunks``); the last response carries the last delta (maybe empty)
  and the finish reason, with the FINAL flag;
* non-streaming: one response, FINAL, with the whole text (the prompt first unless
  ``exclude_input_in_output``);
* failure: one error response, FINAL; after a client cancel: FINAL alone.

Exactly one FINAL per stream: the stream ignores events after its terminal one, and ``ResponseSink``
implementations never touch their transport after FINAL.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from engine.errors import InvalidSamplingParams, RequestRejected
from engine.outputs import RequestOutput, TokenLogprob
from serving.workers.events import LoopEvent, RequestId
from serving.parsing.request import GenerateRequest, RequestError

logger = logging.getLogger(__name__)


class ErrorKind(enum.Enum):
    """Whose fault a failed request is; travels with the error to the router (the child output ``error_kind``),
    which decides by it alone (never by the message) whether another instance should try.

    ``REQUEST``: the request itself (a bad input or sampling parameter, a prompt the engine rejects, a prompt the
    tokenizer cannot take): every instance would answer the same, so it is neither retried nor counted against
    the instance's circuit breaker (a client sending bad requests must not take healthy instances out of
    rotation). ``INSTANCE``: this instance could not serve it (its KV transfer failed or timed out, its peer
    died, it is stopping, an engine fault): another instance may succeed.

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
    (``serving.parsing.child_codec.decode_raw_response``) and what the router's orchestrator hands its responder; only the engine's
    own ``RequestOutput`` comes before it (``GenerationStream`` turns that into deltas).

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
    the counts, the cumulative logprob and the finish reason of ``later``. Used by ``ResponseDispatcher`` to
    send a stream that fell behind as fewer responses (vLLM's and SGLang's ``stream_interval`` idea, driven by
    the backlog instead of a fixed interval).

    Raises:
        ValueError: the two chunks have different sample counts.
    """
    if len(earlier.samples) != len(later.samples):
        raise ValueError(f"cannot merge chunks of {len(earlier.samples)} and {len(later.samples)} samples")
    samples = []
    for a, b in zip(earlier.samples, later.samples):
        logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or ()) + (b.logprobs or ())
        samples.append(replace(b, text=a.text + b.text, num_input_tokens=b.num_input_tokens or a.num_input_tokens,
                               num_new_tokens=a.num_new_tokens + b.num_new_tokens, logprobs=logprobs,
                               num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
                               token_ids=a.token_ids + b.token_ids))
    return ResponseChunk(tuple(samples))


class PendingTokens:
    """What one sample's next response reports beside its text: the tokens generated since the previous
    response, their logprobs and (engine outputs only) their ids. Used by ``GenerationStream`` (engine
    outputs) and the router's responder (child chunks); one thread each."""

    def __init__(self, logprobs_asked: bool) -> None:
        self._logprobs_asked = logprobs_asked
        self._num_sent_tokens = 0
        self._pending: list[TokenLogprob] = []
        self._pending_ids: list[int] = []

    def add(self, logprobs: Iterable[TokenLogprob], token_ids: Iterable[int] = ()) -> None:
        """Logprobs and ids of tokens that arrived and are not sent yet."""
        self._pending.extend(logprobs)
        self._pending_ids.extend(token_ids)

    def take_token_ids(self) -> tuple[int, ...]:
        """The ids added since the previous call, in order; they count as sent."""
        ids = tuple(self._pending_ids)
        self._pending_ids.clear()
        return ids

    def take(self, num_output_tokens: int) -> tuple[int, tuple[TokenLogprob, ...] | None]:
        """For a response sent now, with ``num_output_tokens`` generated so far: ``(new tokens, their logprobs
        or None when the request asked for none)``; what it returns counts as sent."""
        num_new = max(0, num_output_tokens - self._num_sent_tokens)
        self._num_sent_tokens = max(self._num_sent_tokens, num_output_tokens)
        logprobs = tuple(self._pending) if self._logprobs_asked else None
        self._pending.clear()
        return num_new, logprobs


def client_message(error: BaseException) -> str:
    """What the client reads for ``error``: an engine rejection without the worker's internal request id (a PD
    child's id, ``decode@host:port-10``, means nothing to the client), everything else as it is."""
    if isinstance(error, RequestRejected):
        return f"request rejected: {error.reason}"
    return str(error)


def error_kind_of(error: BaseException) -> ErrorKind:
    """``REQUEST`` for the request's own errors (``RequestError``, ``InvalidSamplingParams``,
    ``RequestRejected``), else ``INSTANCE``."""
    return ErrorKind.REQUEST if isinstance(error, RequestError | InvalidSamplingParams | RequestRejected) \
        else ErrorKind.INSTANCE


class ResponseSink(Protocol):
    """Where one request's responses go (``serving.triton.io.TritonResponseSink`` in the server).

    Contract: after the first call with ``final=True``, ``send_error`` or ``close``, the sink is closed: later
    calls do nothing and ``is_cancelled`` returns True without touching the transport. Thread-safe.
    """

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        """Send one response; ``final`` sets the FINAL flag on it."""
        ...

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        """Send one error response with the FINAL flag; ``kind`` says whose fault it is (``ErrorKind``)."""
        ...

    def close(self) -> None:
        """Send the FINAL flag alone (the client cancelled and reads nothing more)."""
        ...

    def is_cancelled(self) -> bool:
        """True when the client cancelled the request (or the sink is closed)."""
        ...


class GenerationStream:
    """Response state of one request; fed on the engine loop thread only."""

    def __init__(self, request_id: RequestId, request: GenerateRequest, sink: ResponseSink) -> None:
        self.request_id = request_id
        self.request = request
        self.sink = sink
        self.cancelled = False
        self.done = False
        self.num_input_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cumulative_logprob = 0.0
        self._text_parts: list[str] = []
        self._pending = PendingTokens(request.params.logprobs is not None)

    def on_event(self, event: LoopEvent) -> bool:
        """Forward one loop event to the sink; returns True when it was the terminal one (FINAL went out)."""
        if self.done:
            logger.warning("request %s: event after its end ignored: %r", self.request_id, event)
            return True
        if isinstance(event, RequestOutput):
            self._on_output(event)
        else:
            self._on_failure(event.error)
        return self.done

    def _on_output(self, output: RequestOutput) -> None:
        self.num_input_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        self.cumulative_logprob = output.cumulative_logprob
        self._pending.add(output.new_token_logprobs, output.new_token_ids)
        if output.finished:
            self.done = True
            self.finish_reason = output.finish_reason
        if self.request.stream:
            if output.new_text or output.finished:
                self.sink.send(self._chunk(output.new_text), final=output.finished)
            return
        self._text_parts.append(output.new_text)
        if output.finished:
            prefix = self.request.prompt if self.request.echo_prompt else ""
            self.sink.send(self._chunk(prefix + "".join(self._text_parts)), final=True)

    def _on_failure(self, error: Exception) -> None:
        self.done = True
        if self.cancelled:
            self.finish_reason = "abort"
            self.sink.close()
            return
        self.error = client_message(error)
        logger.info("request %s failed: %s", self.request_id, error)
        self.sink.send_error(self.error, error_kind_of(error))

    def _chunk(self, text: str) -> ResponseChunk:
        """The response now: ``text`` and the tokens (and their logprobs) since the previous response."""
        num_new, logprobs = self._pending.take(self.num_output_tokens)
        return ResponseChunk.single(text=text, finish_reason=self.finish_reason if self.done else None,
                                    num_input_tokens=self.num_input_tokens,
                                    num_output_tokens=self.num_output_tokens, num_new_tokens=num_new,
                                    cumulative_logprob=self.cumulative_logprob, logprobs=logprobs,
                                    num_cached_tokens=self.num_cached_tokens,
                                    token_ids=self._pending.take_token_ids())
