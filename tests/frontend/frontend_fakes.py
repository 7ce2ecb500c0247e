"""A scripted ``Backend`` for the front's unit tests: no network; it records what it was sent and whether each
stream was closed before its FINAL response (a cancel)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from frontend.backend import Backend, TritonError
from frontend.wire import BackendRequest, BackendResponse, Contract, SampleDelta


@dataclass
class Script:
    """What the fake answers: ``responses`` in order (``delay_s`` before each), then ``error`` if set."""

    responses: Sequence[BackendResponse] = ()
    error: str | None = None
    delay_s: float = 0.0


@dataclass
class FakeBackend:
    script: Script = field(default_factory=Script)
    is_ready: bool = True
    sent: list[BackendRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    closed: bool = False

    async def contract(self) -> Contract:
        return Contract(frozenset({"text_input", "return_num_output_tokens"}))

    async def generate(self, request: BackendRequest) -> AsyncGenerator[BackendResponse, None]:
        self.sent.append(request)
        done = False
        try:
            for response in self.script.responses:
                await asyncio.sleep(self.script.delay_s)
                done = response.final
                yield response
            if self.script.error is not None:
                done = True
                raise TritonError(self.script.error)
        finally:
            (self.completed if done else self.cancelled).append(request.request_id)

    async def ready(self) -> bool:
        return self.is_ready

    async def close(self) -> None:
        self.closed = True


_typed: Backend = FakeBackend()   # the fake implements the seam (mypy checks this line)


def text_responses(pieces: Sequence[str], prompt_tokens: int = 5, reason: str = "length",
                   cached_tokens: int | None = None) -> list[BackendResponse]:
    """One sample: one response per piece (one token each), the last with ``reason`` and FINAL; each with
    ``cached_tokens`` as its ``num_cached_tokens`` (None: the server sends none)."""
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        counts = {} if cached_tokens is None else {"num_cached_tokens": cached_tokens}
        delta = SampleDelta(0, piece, reason if last else None, 1, counts=counts)
        out.append(BackendResponse((delta,), prompt_tokens, last))
    return out
