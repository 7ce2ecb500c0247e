"""``n`` samples of one prompt: one client stream fed by ``n`` sample streams.

A request with ``n > 1`` runs as ``n`` independent requests (colocated: ``n`` engine requests; PD: ``n``
prefill/decode pairs), sample ``i`` with ``SamplingParams.for_sample(i)`` (seed ``seed + i``), as vLLM's
parallel sampling expands a request. ``SampleFanIn`` gives each sample its own ``ResponseSink`` and merges
what they send into the client's responses, in the layout of the vLLM backend (one entry per sample in every
output, index = sample index):

* streaming: each sample response becomes one client response whose other entries are empty (no text, no new
  tokens, the sample's finish reason so far); the response that ends the last sample carries FINAL;
* non-streaming: one response, FINAL, once every sample ended;
* a failure of any sample: the client gets that error (FINAL); the other samples see ``is_cancelled()`` and
  their workers abort them, freeing their pages;
* a client cancel: every sample sees it; FINAL alone goes out once.

Thread-safe (one lock): samples may report from different threads (engine loop, router event loop).
"""

from __future__ import annotations

import threading
from dataclasses import replace

from serving.delta import Delta, ErrorKind, ResponseChunk
from serving.stream import ResponseSink


class SampleFanIn:
    def __init__(self, sink: ResponseSink, n: int, stream: bool, logprobs: bool) -> None:
        """
        Args:
            sink: the client's stream.
            n: number of samples (>= 1).
            stream: the client streams (one response per sample response) or not (one response at the end).
            logprobs: the request asked for logprobs (empty entries then carry an empty list, not None).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._sink = sink
        self._n = n
        self._stream = stream
        self._logprobs = logprobs
        self._lock = threading.Lock()
        self._closed = False
        self._latest: list[Delta] = [Delta(logprobs=() if logprobs else None) for _ in range(n)]
        self._done = [False] * n
        self._final: list[Delta | None] = [None] * n

    def sample_sink(self, index: int) -> ResponseSink:
        """The ``ResponseSink`` of sample ``index`` (``0 <= index < n``): it takes one-sample chunks."""
        if not 0 <= index < self._n:
            raise IndexError(index)
        return _SampleSink(self, index)

    def _send(self, index: int, chunk: ResponseChunk, final: bool) -> None:
        sample = chunk.samples[0]
        with self._lock:
            if self._closed or self._done[index]:
                return
            self._done[index] = final
            self._latest[index] = sample
            everything_done = all(self._done)
            self._closed = everything_done
            if self._stream:
                samples = tuple(sample if i == index else self._idle(i) for i in range(self._n))
                self._sink.send(ResponseChunk(samples), final=everything_done)
                return
            if final:
                self._final[index] = sample
            if everything_done:
                samples = tuple(s if s is not None else Delta() for s in self._final)
                self._sink.send(ResponseChunk(samples), final=True)

    def _idle(self, index: int) -> Delta:
        """What a response that is about another sample says of sample ``index``: nothing new."""
        last = self._latest[index]
        return replace(last, text="", num_new_tokens=0, logprobs=() if self._logprobs else None, token_ids=())

    def _send_error(self, message: str, kind: ErrorKind) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sink.send_error(message, kind)

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sink.close()

    def _is_cancelled(self) -> bool:
        with self._lock:
            closed = self._closed
        return closed or self._sink.is_cancelled()


class _SampleSink:
    """One sample's view of a ``SampleFanIn`` (the ``ResponseSink`` contract: nothing after FINAL)."""

    def __init__(self, fan_in: SampleFanIn, index: int) -> None:
        self._fan_in = fan_in
        self._index = index

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        self._fan_in._send(self._index, chunk, final)

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self._fan_in._send_error(message, kind)

    def close(self) -> None:
        self._fan_in._close()

    def is_cancelled(self) -> bool:
        return self._fan_in._is_cancelled()
