"""``Intake``: how a PD worker takes requests from Triton's execute thread to its engine loop thread."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from engine.errors import InvalidSamplingParams
from serving.delta import ErrorKind
from serving.parsing.pd_request import PDRequest
from serving.parsing.prompt import Tokenizer, prompt_token_ids
from serving.parsing.request import RequestError
from serving.stream import ResponseSink
from serving.workers.engine_loop import EngineLoop

J = TypeVar("J")


class WorkerTokenizer(Tokenizer, Protocol):
    """The part of ``engine.model.tokenizer.Tokenizer`` a PD worker's intake uses: ``Tokenizer`` plus the
    vocabulary size and the fingerprint that tells whether the router's forwarded ids are this tokenizer's."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...


class Intake(Generic[J]):
    """Tokenizes (and compiles a structured-outputs grammar) on the caller's thread, queues the job, wakes the
    loop; the loop thread ``take``s the jobs. A router request carries the prompt's ids already
    (``PDRequest.prompt_token_ids``): they are taken as they are when the router's tokenizer is this one
    (same fingerprint), so a prompt is tokenized once per request, by the router."""

    def __init__(self, loop: EngineLoop, tokenizer: WorkerTokenizer, name: str) -> None:
        """
        Args:
            loop: the worker's engine loop.
            tokenizer: the engine's tokenizer.
            name: prefix of the request ids (the instance name).
        """
        self._loop = loop
        self._tokenizer = tokenizer
        self._name = name
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._jobs: list[J] = []

    def accept(self, pd: PDRequest, sink: ResponseSink, make_job: Callable[[str, list[int]], J]) -> str:
        """Queue ``make_job(request_id, prompt_token_ids)``; on a tokenizer error, a grammar that cannot be
        compiled or a stopped loop, answer ``sink`` with an error instead. Never raises. Returns the request
        id."""
        request_id = f"{self._name}-{next(self._ids)}"
        fingerprint = self._tokenizer.fingerprint
        if pd.prompt_token_ids and fingerprint and pd.tokenizer_id == fingerprint:
            token_ids = list(pd.prompt_token_ids)
            if max(token_ids) >= self._tokenizer.vocab_size:
                sink.send_error(str(RequestError("prompt_token_ids", f"token id {max(token_ids)} is not "
                                                 f"below the vocabulary size {self._tokenizer.vocab_size}")),
                                ErrorKind.REQUEST)
                return request_id
        else:
            try:
                token_ids = prompt_token_ids(self._tokenizer, pd.request)
            except Exception as e:  # a template or tokenizer error concerns this request only
                sink.send_error(f"tokenization failed: {e}", ErrorKind.REQUEST)
                return request_id
        try:
            self._loop.prepare(pd.request.params)
        except InvalidSamplingParams as e:
            sink.send_error(str(RequestError(f"sampling_parameters.{e.param}", e.reason)), ErrorKind.REQUEST)
            return request_id
        if not self._loop.running:
            sink.send_error(f"{self._name} is not running", ErrorKind.INSTANCE)
            return request_id
        with self._lock:
            self._jobs.append(make_job(request_id, token_ids))
        self._loop.wake()
        return request_id

    def take(self) -> list[J]:
        """Every job queued since the last call, oldest first."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        return jobs

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)
