"""Orchestrator chunks → the client's responses, in the Triton LLM convention (what vLLM's backend does).

Streaming: one response per text delta, then a last response with the finish reason and FINAL.
Non-streaming: one response, FINAL, with the whole text (the prompt first unless ``exclude_input_in_output``).
An error: one error response, FINAL. A client cancel: FINAL alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.request import GenerateRequest
from serving.stream import ResponseChunk, ResponseSink


@dataclass(frozen=True)
class OutputChunk:
    """What the router sends its client in one response."""

    text: str
    final: bool
    finish_reason: str | None = None
    error: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0


class EnsembleResponder:
    def __init__(self, request: GenerateRequest, sink: ResponseSink) -> None:
        self._request = request
        self._sink = sink
        self._parts: list[str] = []

    def emit(self, chunk: OutputChunk) -> None:
        if chunk.error is not None:
            self._sink.send_error(chunk.error)
            return
        if chunk.final and chunk.finish_reason == "abort" and self._sink.is_cancelled():
            self._sink.close()
            return
        if self._request.stream:
            if chunk.text or chunk.final:
                self._sink.send(self._response(chunk.text, chunk), final=chunk.final)
            return
        self._parts.append(chunk.text)
        if chunk.final:
            prefix = self._request.prompt if self._request.echo_prompt else ""
            self._sink.send(self._response(prefix + "".join(self._parts), chunk), final=True)

    @staticmethod
    def _response(text: str, chunk: OutputChunk) -> ResponseChunk:
        return ResponseChunk(text=text, finish_reason=chunk.finish_reason if chunk.final else None,
                             num_input_tokens=chunk.num_input_tokens, num_output_tokens=chunk.num_output_tokens)
