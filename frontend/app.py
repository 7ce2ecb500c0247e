"""The FastAPI application: routes, SSE streaming, OpenAI error bodies, client-disconnect cancellation.

Life of one request (all on the front's event loop):

1. FastAPI parses the body into a pydantic request (unknown or bad fields → 400 naming the field).
2. ``mapping`` checks what this server cannot honour (400 naming the field) and builds the ``BackendRequest``
   (a chat request's messages rendered with the model's chat template).
3. The backend stream starts. Until its first response, a watcher waits for the client's ``http.disconnect``:
   a client that leaves cancels the stream (the server aborts the request and frees its KV pages). An error
   response before any text becomes an HTTP error with OpenAI's body and the mapped status.
4. Streaming: an SSE ``StreamingResponse`` sends one chunk per response that changed a choice, then (with
   ``stream_options.include_usage``) a chunk with empty ``choices`` and ``usage``, then ``data: [DONE]``;
   Starlette cancels the body on disconnect, and the backend stream is cancelled with it. An error after
   the 200 went out is an SSE ``data: {"error": ...}`` event, then ``[DONE]``.
   Not streaming: the whole stream is collected under the same disconnect watcher, then answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend import mapping
from frontend.backend import Backend, BackendUnavailable, TritonError
from frontend.chat import ChatRenderer
from frontend.config import FrontendConfig
from frontend.errors import OpenAIError, from_triton_message
from frontend.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    ErrorBody,
    ErrorInfo,
    ModelCard,
    ModelList,
)
from frontend.tool_stream import ToolCallStream
from frontend.wire import BackendRequest, BackendResponse, Totals

logger = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_CLOSED_STATUS = 499   # nginx's "client closed request": nobody reads it, the logs do


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its backend request was cancelled."""


def create_app(config: FrontendConfig, backend: Backend, renderer: ChatRenderer) -> FastAPI:
    """The application; ``backend`` and ``renderer`` are used on the event loop that serves it, and the
    backend is closed when the application shuts down (after uvicorn ended every open request)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(title="triton-pd OpenAI front", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())
    app.state.config = config

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        if exc.status >= 500:   # the server's or the front's failure, not the client's: keep a trace of it
            logger.warning("%s %s -> %d %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(exc.body().model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(exc).body().model_dump(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorBody(error=ErrorInfo(message=str(exc.detail), type="invalid_request_error"))
        return JSONResponse(body.model_dump(), status_code=exc.status_code)

    def check_model(name: str) -> str:
        if name not in (config.public_name, config.model):
            raise OpenAIError(404, f"The model '{name}' does not exist; this server serves "
                              f"'{config.public_name}'", "invalid_request_error", "model", "model_not_found")
        return config.public_name

    @app.get("/health")
    async def health() -> Response:
        if await backend.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "model": config.model, "grpc_url": config.grpc_url},
                            status_code=503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=config.public_name, created=created)])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = check_model(body.model)
        backend_request = BackendRequest(f"cmpl-{uuid.uuid4().hex}", mapping.completion_prompt(body),
                                         mapping.completion_sampling(body), body.logprobs is not None)
        stream = generate(backend, backend_request, "prompt")
        now, want_logprobs = int(time.time()), body.logprobs is not None
        if not body.stream:
            totals = await until_disconnected(request, collect(stream, backend_request.n))
            return json_response(mapping.completion_response(totals, backend_request.request_id, now, model,
                                                             want_logprobs))
        first = await until_disconnected(request, anext(stream))
        offsets: list[int] = []

        def chunk(r: BackendResponse) -> CompletionChunk | None:
            return mapping.completion_chunk(r, backend_request.request_id, now, model, want_logprobs, offsets)

        def usage(totals: Totals) -> CompletionChunk:
            return CompletionChunk(id=backend_request.request_id, created=now, model=model, choices=[],
                                   usage=mapping.usage_of(totals))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(events(first, stream, backend_request.n, None, chunk, usage if include_usage else None))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = check_model(body.model)
        plan = mapping.tool_plan(body)
        prompt = renderer.render(mapping.chat_messages(body, plan))
        top = (body.top_logprobs or 0) if body.logprobs else None
        backend_request = BackendRequest(f"chatcmpl-{uuid.uuid4().hex}", prompt,
                                         mapping.chat_sampling(body, config.default_max_tokens, plan),
                                         top is not None)
        stream = generate(backend, backend_request, "messages",
                          "tools" if plan is not None and plan.constrained else "response_format")
        now, rid, n = int(time.time()), backend_request.request_id, backend_request.n
        if not body.stream:
            totals = await until_disconnected(request, collect(stream, n))
            return json_response(mapping.chat_response(totals, rid, now, model, top, plan))
        first = await until_disconnected(request, anext(stream))
        calls = ToolCallStream(plan) if plan is not None and plan.mode != "none" else None

        def chunk(r: BackendResponse) -> ChatCompletionChunk | None:
            return mapping.chat_chunk(r, rid, now, model, top, calls)

        def usage(totals: Totals) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=now, model=model, choices=[],
                                       usage=mapping.usage_of(totals))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse(events(first, stream, n, mapping.chat_role_chunk(n, rid, now, model), chunk,
                          usage if include_usage else None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_STATUS)

    return app


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The 400 of a body that does not parse, naming the first bad field (``messages[0].role``)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if first.get("type") == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", "invalid_request_error",
                           param)
    return OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", "invalid_request_error",
                       param)


async def generate(backend: Backend, request: BackendRequest, prompt_field: str,
                   constraint_field: str = "response_format") -> AsyncGenerator[BackendResponse, None]:
    """``backend.generate`` with its errors as ``OpenAIError`` (``prompt_field`` / ``constraint_field``: the
    OpenAI fields that became ``text_input`` / ``structured_outputs``, named in them); closing this closes
    (cancels) the backend's."""
    try:
        async with contextlib.aclosing(backend.generate(request)) as responses:
            async for response in responses:
                yield response
    except TritonError as e:
        raise from_triton_message(str(e), prompt_field, constraint_field) from None
    except BackendUnavailable as e:
        raise OpenAIError(503, str(e), "service_unavailable") from None


async def collect(stream: AsyncIterator[BackendResponse], n: int) -> Totals:
    totals = Totals(n)
    async for response in stream:
        totals.add(response)
    return totals


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which cancels its backend stream)
    and raise ClientDisconnected. Raises what ``work`` raises (``StopAsyncIteration`` → 500)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            logger.info("client disconnected before the answer; request cancelled")
            raise ClientDisconnected()
    try:
        return task.result()
    except StopAsyncIteration:
        raise OpenAIError(500, "the server ended the stream without a response", "internal_error") from None


async def _disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def events(first: BackendResponse, stream: AsyncGenerator[BackendResponse, None], n: int,
                 opening: BaseModel | None, chunk: Callable[[BackendResponse], BaseModel | None],
                 usage: Callable[[Totals], BaseModel] | None) -> AsyncIterator[str]:
    """SSE events of a stream whose first response is ``first``: ``opening``, one chunk per response, usage,
    ``[DONE]``; an error mid-stream becomes an error event. Closing this closes (cancels) ``stream``."""
    totals = Totals(n)
    try:
        if opening is not None:
            yield _event(opening)
        response: BackendResponse | None = first
        while response is not None:
            totals.add(response)
            if (out := chunk(response)) is not None:
                yield _event(out)
            response = None if response.final else await anext(stream, None)
        if usage is not None:
            yield _event(usage(totals))
    except OpenAIError as e:
        logger.warning("stream failed after its first response: %s", e)
        yield f"data: {e.body().model_dump_json()}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"


def _event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_none=True)}\n\n"


def sse(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def json_response(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump())
