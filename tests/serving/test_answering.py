"""start_or_fail: a request that cannot start ends with exactly one error response of the right kind, and the
entry point goes on (it never raises)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from serving.answering import start_or_fail
from serving.child.codec import ChildSchemaMismatch
from serving.delta import ErrorKind, ResponseChunk
from serving.parsing.request import RequestError


class Refused(Exception):
    pass


class RecordingSink:
    def __init__(self) -> None:
        self.errors: list[tuple[str, ErrorKind]] = []

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        raise AssertionError("no response expected")

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        self.errors.append((message, kind))

    def close(self) -> None:
        pass

    def is_cancelled(self) -> bool:
        return False


def raising(error: Exception) -> Callable[[], None]:
    def start() -> None:
        raise error
    return start


@pytest.mark.parametrize(("error", "message", "kind"), [
    (RequestError("max_tokens", "must be > 0"), "invalid input 'max_tokens': must be > 0", ErrorKind.REQUEST),
    (ChildSchemaMismatch("child schema abc, router def"), "child schema abc, router def", ErrorKind.INSTANCE),
    (Refused("being unloaded"), "being unloaded", ErrorKind.INSTANCE),
    (KeyError("x"), "internal error: 'x'", ErrorKind.INSTANCE),
])
def test_a_request_that_cannot_start_gets_one_error_of_its_kind(error: Exception, message: str,
                                                                 kind: ErrorKind) -> None:
    sink = RecordingSink()
    start_or_fail(raising(error), sink, "r1", refusals=(Refused,))
    assert sink.errors == [(message, kind)]


def test_a_request_that_starts_gets_nothing_from_it() -> None:
    sink, started = RecordingSink(), []
    start_or_fail(lambda: started.append(1), sink, "r1")
    assert started == [1] and sink.errors == []
