"""One client stream: engine events of a request → the responses the Triton LLM convention promises.

``GenerationStream`` turns the ``LoopEvent``s of one request into ``ResponseChunk``s on a ``ResponseSink``:

* streaming: one response per non-empty text delta; the last response carries the last delta (maybe empty)
  and the finish reason, with the FINAL flag;
* non-streaming: one response, FINAL, with the whole text (the prompt first unless
  ``exclude_input_in_output``);
* failure: one error response, FINAL; after a client cancel: FINAL alone.

Exactly one FINAL per stream: the stream ignores events after its terminal one, and ``ResponseSink``
implementations never touch their transport after FINAL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from engine.outputs import RequestOutput
from serving.events import LoopEvent, RequestId
from serving.request import GenerateRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResponseChunk:
    """The payload of one response (the outputs ``text_output``, ``finish_reason``, ``num_*_tokens``).

    Attributes:
        text: text of this response (a delta when streaming, the whole text otherwise).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` on the last response, else None.
        num_input_tokens: prompt length in tokens (after the chat template).
        num_output_tokens: tokens generated so far.
    """

    text: str
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0


class ResponseSink(Protocol):
    """Where one request's responses go (``triton_io.TritonResponseSink`` in the server).

    Contract: after the first call with ``final=True``, ``send_error`` or ``close``, the sink is closed: later
    calls do nothing and ``is_cancelled`` returns True without touching the transport. Thread-safe.
    """

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        """Send one response; ``final`` sets the FINAL flag on it."""
        ...

    def send_error(self, message: str) -> None:
        """Send one error response with the FINAL flag."""
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
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._text_parts: list[str] = []

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
        self.error = str(error)
        logger.info("request %s failed: %s", self.request_id, error)
        self.sink.send_error(self.error)

    def _chunk(self, text: str) -> ResponseChunk:
        return ResponseChunk(text=text, finish_reason=self.finish_reason if self.done else None,
                             num_input_tokens=self.num_input_tokens, num_output_tokens=self.num_output_tokens)
