"""Events an ``EngineLoop`` hands to a request's callback, and the loop's own errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import EngineError
from engine.outputs import RequestOutput

RequestId = str


class LoopStopped(RuntimeError):
    """The loop is not running (not started yet, or stopped): the request was not taken."""


class RequestAborted(EngineError):
    """A request was aborted before it finished (client cancel, shutdown, caller's abort).

    Attributes:
        request_id: the aborted request.
        reason: why.
    """

    def __init__(self, request_id: RequestId, reason: str) -> None:
        super().__init__(f"request {request_id!r} aborted: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True)
class RequestFailed:
    """Terminal event of a request that will produce no more outputs.

    Attributes:
        request_id: the request.
        error: why (``RequestRejected``, ``RequestAborted``, ``LoopStopped``, or an unexpected engine error).
    """

    request_id: RequestId
    error: Exception


LoopEvent = RequestOutput | RequestFailed
OnEvent = Callable[[LoopEvent], None]
