"""``InProcessLauncher``: the router's ``Launcher`` over PD workers living in the same process (tests,
benchmarks of the serving packages without Triton).

Each call becomes ``worker.handle(PDRequest, sink)`` on the worker registered under the call's instance id;
the sink hands the worker's responses (sent from its engine loop thread) to the router's event loop. Closing
the stream early marks the sink cancelled, which the worker sees as a client cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Protocol

from serving.delta import Delta, ErrorKind, ResponseChunk
from serving.parsing.pd_request import PDRequest
from serving.parsing.request import parse_request
from serving.router.launch import ChildCall, ChildUnavailable
from serving.stream import ResponseSink


class PDWorker(Protocol):
    """``PrefillWorker`` / ``DecodeWorker`` as the launcher uses them."""

    def handle(self, pd: PDRequest, sink: ResponseSink) -> str: ...


class _LoopSink:
    """``ResponseSink`` that forwards to an asyncio queue on ``loop`` (thread-safe; FINAL once)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.cancelled = False
        self._loop = loop
        self._closed = False

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        # what the child codec would carry: the one sample, without the client-only new-token count
        self._put(replace(chunk.samples[0], num_new_tokens=0, final=final))

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self._put(Delta.failure(message, kind))

    def close(self) -> None:
        self._put(Delta(final=True))

    def is_cancelled(self) -> bool:
        return self.cancelled or self._closed

    def _put(self, response: Delta) -> None:
        if self._closed:
            return
        self._closed = response.final
        self._loop.call_soon_threadsafe(self.queue.put_nowait, response)


class InProcessLauncher:
    def __init__(self, workers: Mapping[str, PDWorker]) -> None:
        """``workers``: instance id → worker (the ids the fleet lists)."""
        self._workers = dict(workers)

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        worker = self._workers.get(call.target.instance_id)
        if worker is None:
            raise ChildUnavailable(f"no worker {call.target.instance_id} in this process")
        request = replace(parse_request(dict(call.inputs)), stream=True, exclude_input_in_output=True)
        sink = _LoopSink(asyncio.get_running_loop())
        worker.handle(PDRequest(request, call.room, call.prefill_instance, call.prefill_rendezvous,
                                call.resume_token_ids, call.prompt_token_ids, call.tokenizer_id,
                                call.target.dp_rank), sink)
        finished = False
        try:
            while not finished:
                response = await sink.queue.get()
                finished = response.final
                yield response
        finally:
            if not finished:
                sink.cancelled = True

    def reset(self, endpoint: str) -> None:
        pass   # no connections

    async def close(self) -> None:
        pass
