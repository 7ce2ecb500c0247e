"""Orchestrator chunks → the client's responses, in the Triton LLM convention (what vLLM's backend does).

Streaming: one response per text delta, then a last response with the finish reason and FINAL.
Non-streaming: one response, FINAL, with the whole text (the prompt first unless ``exclude_input_in_output``).
An error: one error response, FINAL. A client cancel: FINAL alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import TokenLogprob
from serving.request import GenerateRequest
from serving.stream import ErrorKind, ResponseChunk, ResponseDelta, ResponseSink


@dataclass(frozen=True)
class OutputChunk:
    """What the orchestrator hands the responder for one sample.

    Attributes:
        text: new text (a delta).
        final: the sample's last chunk.
        finish_reason: on the final chunk: ``"stop"``, ``"length"``, ``"abort"``.
        error: the request failed with this message (final).
        error_kind: whose fault ``error`` is (the child's ``ErrorKind``; the router's own failures: ``INSTANCE``).
        num_input_tokens: prompt tokens.
        num_output_tokens: tokens generated so far (cumulative).
        cumulative_logprob: sum of the raw logprobs of those tokens.
        logprobs: logprobs of the tokens this chunk adds, when the request asked for them.
        num_cached_tokens: prompt tokens the prefix cache of the instance that prefilled supplied.
    """

    text: str
    final: bool
    finish_reason: str | None = None
    error: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: tuple[TokenLogprob, ...] | None = None
    num_cached_tokens: int = 0
    error_kind: ErrorKind = ErrorKind.INSTANCE


class EnsembleResponder:
    """Turns one sample's ``OutputChunk``s into responses on ``sink``; on the router's event loop thread."""

    def __init__(self, request: GenerateRequest, sink: ResponseSink) -> None:
        self._request = request
        self._sink = sink
        self._parts: list[str] = []
        self._delta = ResponseDelta(request.params.logprobs is not None)

    def emit(self, chunk: OutputChunk) -> None:
        if chunk.error is not None:
            self._sink.send_error(chunk.error, chunk.error_kind)
            return
        if chunk.final and chunk.finish_reason == "abort" and self._sink.is_cancelled():
            self._sink.close()
            return
        self._delta.add(chunk.logprobs or ())
        if self._request.stream:
            if chunk.text or chunk.final:
                self._sink.send(self._response(chunk.text, chunk), final=chunk.final)
            return
        self._parts.append(chunk.text)
        if chunk.final:
            prefix = self._request.prompt if self._request.echo_prompt else ""
            self._sink.send(self._response(prefix + "".join(self._parts), chunk), final=True)

    def _response(self, text: str, chunk: OutputChunk) -> ResponseChunk:
        """The response now: ``text`` and the tokens (and logprobs) since the previous response."""
        num_new, logprobs = self._delta.take(chunk.num_output_tokens)
        return ResponseChunk.single(text, chunk.finish_reason if chunk.final else None, chunk.num_input_tokens,
                                    chunk.num_output_tokens, num_new, chunk.cumulative_logprob, logprobs,
                                    chunk.num_cached_tokens)
