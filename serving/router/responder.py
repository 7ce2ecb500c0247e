"""Orchestrator deltas → the client's responses, in the Triton LLM convention (what vLLM's backend does).

Streaming: one response per text delta, then a last response with the finish reason and FINAL.
Non-streaming: one response, FINAL, with the whole text (the prompt first unless ``exclude_input_in_output``).
An error: one error response, FINAL. A client cancel: FINAL alone.
"""

from __future__ import annotations

from dataclasses import replace

from serving.delta import Delta, ResponseChunk
from serving.parsing.request import GenerateRequest
from serving.stream import PendingTokens, ResponseSink


class EnsembleResponder:
    """Turns one sample's ``Delta``s into responses on ``sink``; on the router's event loop thread."""

    def __init__(self, request: GenerateRequest, sink: ResponseSink) -> None:
        self._request = request
        self._sink = sink
        self._parts: list[str] = []
        self._pending = PendingTokens(request.params.logprobs is not None)

    def emit(self, delta: Delta) -> None:
        if delta.error is not None:
            self._sink.send_error(delta.error, delta.error_kind)
            return
        if delta.final and delta.finish_reason == "abort" and self._sink.is_cancelled():
            self._sink.close()
            return
        self._pending.add(delta.logprobs or ())
        if self._request.stream:
            if delta.text or delta.final:
                self._sink.send(self._response(delta.text, delta), final=delta.final)
            return
        self._parts.append(delta.text)
        if delta.final:
            prefix = self._request.prompt if self._request.echo_prompt else ""
            self._sink.send(self._response(prefix + "".join(self._parts), delta), final=True)

    def _response(self, text: str, delta: Delta) -> ResponseChunk:
        """The response now: ``text`` and the tokens (and logprobs) since the previous response."""
        num_new, logprobs = self._pending.take(delta.num_output_tokens)
        return ResponseChunk((replace(delta, text=text,
                                      finish_reason=delta.finish_reason if delta.final else None,
                                      num_new_tokens=num_new, logprobs=logprobs, token_ids=()),))
