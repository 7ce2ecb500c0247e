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

import logging
from collections.abc import Iterable
from typing import Protocol

from engine.errors import InvalidSamplingParams, RequestRejected
from engine.outputs import RequestOutput, TokenLogprob
from serving.delta import ErrorKind, ResponseChunk
from serving.events import LoopEvent, RequestId
from serving.parsing.request import GenerateRequest, RequestError

logger = logging.getLogger(__name__)


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
