"""``TritonGrpcBackend.generate`` ends each gRPC call the way tritonserver 2.51 needs: a stream whose FINAL
arrived is read on to the call's end (never dropped for grpc.aio to cancel when it collects it: a cancel
racing the end of a finished stream keeps the model loaded until the server's exit timeout, docs/healing.md
section 4), also when the consumer closes the generator at the FINAL it was given; a stream closed before
its FINAL is cancelled. A fake aio client stands in for tritonclient's (the live path: test_frontend_live)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from frontend.backend import TritonGrpcBackend
from frontend.wire import BackendRequest, Contract

CONTRACT = Contract(frozenset({"text_input", "stream", "sampling_parameters", "exclude_input_in_output"}))


class _Params(dict):
    pass


class _Result:
    def __init__(self, text: str, final: bool) -> None:
        self._text, self._final = text, final

    def as_numpy(self, name: str) -> np.ndarray | None:
        return np.array([self._text.encode()], dtype=object) if name == "text_output" else None

    def get_response(self) -> Any:
        flag = type("Flag", (), {"bool_param": self._final})()
        return type("Response", (), {"parameters": {"triton_final_response": flag}})()


class _Call:
    """The async iterator ``stream_infer`` returns: its responses, then the call's end once the client's half
    is closed (the requests iterator exhausted)."""

    def __init__(self, requests: Any, results: list[_Result]) -> None:
        self._requests, self._results = requests, results
        self.cancelled = False
        self.ended = False   # the iteration reached the call's end (StopAsyncIteration)

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> tuple[_Result, None]:
        if self._results:
            if len(self._results) == 2:   # the request is sent before the first response
                await anext(self._requests)
            return self._results.pop(0), None
        async for _ in self._requests:   # the server ends the call after the client's half closes
            pass
        self.ended = True
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _Client:
    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def stream_infer(self, requests: Any) -> _Call:
        self.calls.append(_Call(requests, [_Result("a", False), _Result("b", True)]))
        return self.calls[-1]


def _backend() -> tuple[TritonGrpcBackend, _Client]:
    backend = TritonGrpcBackend("127.0.0.1:1", "pd_ensemble")
    client = _Client()
    backend._client, backend._contract = client, CONTRACT   # noqa: SLF001 - the fake stands in for the channel
    return backend, client


def test_a_stream_read_to_its_final_is_read_on_to_the_calls_end_not_cancelled() -> None:
    backend, client = _backend()

    async def consume() -> list[bool]:
        return [r.final async for r in backend.generate(BackendRequest("r1", "p", {}))]

    assert asyncio.run(consume()) == [False, True]
    assert client.calls[0].ended and not client.calls[0].cancelled


def test_a_consumer_that_closes_the_generator_at_the_final_still_ends_the_call() -> None:
    """What the SSE route does: it stops asking after the response marked final, then closes the stream."""
    backend, client = _backend()

    async def consume() -> None:
        gen = backend.generate(BackendRequest("r2", "p", {}))
        while not (await anext(gen)).final:
            pass
        await gen.aclose()

    asyncio.run(consume())
    assert client.calls[0].ended and not client.calls[0].cancelled


def test_a_stream_closed_before_its_final_is_cancelled() -> None:
    backend, client = _backend()

    async def consume() -> None:
        gen = backend.generate(BackendRequest("r3", "p", {}))
        await anext(gen)
        await gen.aclose()

    asyncio.run(consume())
    assert client.calls[0].cancelled and not client.calls[0].ended
