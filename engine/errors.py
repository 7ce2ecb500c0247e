"""Typed engine errors. Each concerns a single request (or a single parameter), never the whole engine, but
``TensorParallelError``: a rank group that failed ends the engine."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class RequestRejected(EngineError):
    """A request the engine will not run.

    Raised by ``LLMEngine.add_request`` / ``reserve_request`` when the request could never run (empty prompt,
    longer than the model's context, needs more pages than the pool has, duplicate id).

    Attributes:
        request_id: the rejected request.
        reason: human-readable cause.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id = request_id
        self.reason = reason


class OutOfPages(RequestRejected):
    """The pool is short *now* (the request would fit in an empty pool): retry after other requests finish.

    Raised only by ``LLMEngine.reserve_request`` (decode mode), which cannot queue a reservation;
    ``add_request`` queues such a request instead.
    """


class InvalidSamplingParams(EngineError, ValueError):
    """A sampling parameter has a wrong type, a value outside its range, or an unknown name.

    Attributes:
        param: the parameter's name (``"top_p"``, ...).
        reason: what is wrong with its value.
    """

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"invalid sampling parameter {param!r}: {reason}")
        self.param = param
        self.reason = reason


class TensorParallelError(EngineError):
    """The tensor-parallel rank group of this engine failed: a rank process died, a collective timed out
    (``EngineConfig.tp_timeout_s``) or failed. Sticky: the failed step's requests get it, and so does every
    later step and new request (the engine has stopped its rank processes; a new engine is needed).

    Attributes:
        reason: what failed, naming the rank (and its process id and exit status where one died).
        kind: the group's parallelism, as the message names it: ``"tensor-parallel"`` or
            ``"expert-parallel"`` (an MoE instance's ``expert_parallel_size``).
    """

    def __init__(self, reason: str, kind: str = "tensor-parallel") -> None:
        super().__init__(f"{kind} group failed: {reason}")
        self.reason = reason
        self.kind = kind
