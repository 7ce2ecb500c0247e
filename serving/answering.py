"""``start_or_fail``: how every entry point of a model instance (Triton's ``execute``, a worker's own gRPC
endpoint) starts one request, so that a request that cannot start ends with one error response and FINAL, and
only that request.

Called on the entry point's thread (Triton's execute thread, the endpoint's event loop) for each request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from serving.child.codec import ChildSchemaMismatch
from serving.child.signing import ChildUnauthenticated
from serving.delta import ErrorKind
from serving.parsing.request import RequestError
from serving.stream import ResponseSink

logger = logging.getLogger(__name__)


def start_or_fail(start: Callable[[], None], sink: ResponseSink, request_id: str,
                  refusals: tuple[type[Exception], ...] = ()) -> None:
    """Run ``start`` (parse the request and hand it to the engine; its responses go to ``sink``); a failure
    becomes the request's one error response, with FINAL, on ``sink``. Never raises.

    - ``RequestError`` (the request's own input): ``ErrorKind.REQUEST``, the error's message.
    - ``ChildSchemaMismatch`` (a router of another build), ``ChildUnauthenticated`` (a child request without
      a valid fleet signature) or one of ``refusals`` (the entry point's own reasons to refuse: an endpoint
      being unloaded): ``ErrorKind.INSTANCE``, the message, logged as an error.
    - Anything else is a bug: ``ErrorKind.INSTANCE``, "internal error: <message>", logged with its traceback.
    """
    try:
        start()
    except RequestError as e:
        sink.send_error(str(e), ErrorKind.REQUEST)
    except (ChildSchemaMismatch, ChildUnauthenticated, *refusals) as e:
        logger.error("request %r: %s", request_id, e)
        sink.send_error(str(e), ErrorKind.INSTANCE)
    except Exception as e:  # a bug must still end this request's stream (FINAL), and only this one
        logger.exception("request %r: unexpected error", request_id)
        sink.send_error(f"internal error: {e}", ErrorKind.INSTANCE)
