"""The ``Backend`` seam (where generation requests go) and ``TritonGrpcBackend`` (tritonclient.grpc.aio).

One gRPC channel per front, one bidirectional stream per request (``ModelStreamInfer``): cancelling that
stream cancels exactly that request; Triton then reports ``is_cancelled()`` to the model, which aborts it and
frees its KV pages (for ``pd_ensemble``: the router cancels both children). Every call runs on the front's
event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from frontend.wire import (
    OUTPUT_NAMES,
    BackendRequest,
    BackendResponse,
    Contract,
    ResponseDecoder,
    request_arrays,
)

logger = logging.getLogger(__name__)
#: How long a stream is read on after its FINAL (or an error) for the server to end the call, seconds
STREAM_END_GRACE_S = 2.0


class TritonError(Exception):
    """The server answered the request with an error (its message is in ``str(e)``); nothing was retried."""


class BackendUnavailable(Exception):
    """The server could not be reached, does not serve the model, or its stream broke."""


class Backend(Protocol):
    """Sends generation requests to one served model. Every method is called on the front's event loop."""

    async def contract(self) -> Contract:
        """The served model's declared inputs (read once, then cached). Raises BackendUnavailable."""
        ...

    def generate(self, request: BackendRequest) -> AsyncGenerator[BackendResponse, None]:
        """Send ``request``; yield its responses in order, the last one with ``final`` set. Closing the
        iterator early (``aclose``, or cancelling the task that iterates it) cancels the request on the
        server. Raises TritonError (the server's error response) or BackendUnavailable (no server, broken
        stream)."""
        ...

    async def ready(self) -> bool:
        """True when the server is live and the model is ready; never raises."""
        ...

    async def close(self) -> None:
        """Close the connection; after every request ended."""
        ...


@dataclass(frozen=True)
class GrpcTlsFiles:
    """TLS of the front's channel (``FrontendConfig.grpc_ssl_*``): the CA file, the optional client
    certificate and key files (mutual TLS), the optional name the server's certificate must hold."""

    root_cert: str
    client_cert: str = ""
    client_key: str = ""
    target_name: str = ""


class TritonGrpcBackend:
    """``Backend`` over tritonclient's asyncio gRPC client to ``model`` at ``url`` (``host:port``)."""

    def __init__(self, url: str, model: str, keepalive_s: float = 0.0, health_timeout_s: float = 2.0,
                 tls: GrpcTlsFiles | None = None) -> None:
        """Builds nothing yet: the channel is made on first use (it must belong to the running event loop).

        ``keepalive_s``: HTTP/2 keepalive ping interval, 0 = none (tritonclient's default). tritonserver
        answers pings more frequent than its ``--grpc-http2-min-recv-ping-interval-without-data`` (5 min by
        default) with GOAWAY ``too_many_pings``, which breaks every stream on the channel: seen with 10 s
        pings during a genai-perf run (503s). Set it only below a server configured to accept it.

        ``tls``: speak TLS to a tritonserver with ``--grpc-use-ssl`` (its files are read when the channel is
        made); None: plaintext."""
        self.url = url
        self.model = model
        self._keepalive_s = keepalive_s
        self._health_timeout_s = health_timeout_s
        self._tls = tls
        self._client: Any = None   # tritonclient.grpc.aio.InferenceServerClient (untyped)
        self._contract: Contract | None = None

    def _grpc(self) -> Any:
        if self._client is None:
            from tritonclient.grpc import KeepAliveOptions
            from tritonclient.grpc.aio import InferenceServerClient

            options = KeepAliveOptions()   # no pings
            if self._keepalive_s > 0:
                ms = int(self._keepalive_s * 1000)
                options = KeepAliveOptions(keepalive_time_ms=ms, keepalive_timeout_ms=ms,
                                           keepalive_permit_without_calls=False)
            self._client = InferenceServerClient(self.url, **self._tls_kwargs(options))
        return self._client

    def _tls_kwargs(self, keepalive: Any) -> dict[str, Any]:
        """tritonclient's channel arguments: keepalive, and TLS when set (with a target name, the channel's
        options are given whole: tritonclient then uses them instead of its keepalive defaults)."""
        if self._tls is None:
            return {"keepalive_options": keepalive}
        tls = self._tls
        kwargs: dict[str, Any] = {"keepalive_options": keepalive, "ssl": True,
                                  "root_certificates": tls.root_cert, "private_key": tls.client_key or None,
                                  "certificate_chain": tls.client_cert or None}
        if tls.target_name:
            from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

            kwargs["channel_args"] = [
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
                ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
                ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
                ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
                ("grpc.ssl_target_name_override", tls.target_name)]
        return kwargs

    async def contract(self) -> Contract:
        if self._contract is None:
            from tritonclient.utils import InferenceServerException

            try:
                # metadata, not the model config: a fleet server restricts model-config to its admin key
                # (serving.triton.admin_access); the declared inputs are in both
                metadata = await self._grpc().get_model_metadata(self.model, as_json=True)
            except InferenceServerException as e:
                raise BackendUnavailable(f"model {self.model!r} at {self.url}: {e.message()}") from None
            names = frozenset(item["name"] for item in metadata.get("inputs", []))
            self._contract = Contract(names)
            logger.info("model %s at %s declares inputs %s", self.model, self.url, sorted(names))
        return self._contract

    async def generate(self, request: BackendRequest) -> AsyncGenerator[BackendResponse, None]:
        import grpc
        from tritonclient.grpc import InferInput
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        contract = await self.contract()
        inputs = []
        for name, array in request_arrays(request, contract).items():
            tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        ended = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, object]]:
            yield {"model_name": self.model, "inputs": inputs, "request_id": request.request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
            await ended.wait()   # our half stays open until FINAL: closing it would end the stream

        responses = self._grpc().stream_infer(requests())
        decoder = ResponseDecoder(contract)
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True
                    raise TritonError(error.message())
                final = bool(result.get_response().parameters["triton_final_response"].bool_param)
                values = {name: array for name in OUTPUT_NAMES
                          if (array := result.as_numpy(name)) is not None}
                finished = final
                yield decoder.decode(values, final)
                if final:
                    return
            finished = True
            raise BackendUnavailable(f"{self.model} at {self.url}: the stream ended without FINAL")
        except (grpc.RpcError, InferenceServerException) as e:
            finished = True
            raise BackendUnavailable(f"{self.model} at {self.url} unreachable: {_rpc_message(e)}") from None
        finally:
            ended.set()   # our half closes: after FINAL (or an error) the server ends the call
            if not finished:
                responses.cancel()   # Triton cancels the request: the model aborts it and frees its pages
                logger.info("request %s cancelled on %s", request.request_id, self.model)
            else:   # also when the consumer closes this generator at the FINAL it was given
                await _read_to_end(responses)

    async def ready(self) -> bool:
        try:
            client = self._grpc()
            return bool(await asyncio.wait_for(client.is_model_ready(self.model), self._health_timeout_s))
        except Exception:   # any failure means "not ready": health must answer, never raise
            logger.debug("health check of %s failed", self.url, exc_info=True)
            return False

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def _rpc_message(error: BaseException) -> str:
    details = getattr(error, "details", None)
    code = getattr(error, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)


async def _read_to_end(responses: Any) -> None:
    """Read a stream whose FINAL (or error) arrived on to the call's end, up to ``STREAM_END_GRACE_S``.
    Why: grpc.aio cancels a call that is dropped before its end when it collects it, and a cancel that races
    the end of a stream whose FINAL went out makes tritonserver 2.51's gRPC frontend keep the model loaded
    until its exit timeout (docs/healing.md section 4: the router's server then took 40 s to stop after a
    chaos run whose load client dropped its calls so). Never raises."""
    async def drain() -> None:
        async for _ in responses:
            pass
    try:
        await asyncio.wait_for(drain(), STREAM_END_GRACE_S)
    except Exception:  # noqa: BLE001 - the request is answered; a call that does not end is left to grpc
        logger.debug("a stream did not end within %s s of its FINAL", STREAM_END_GRACE_S, exc_info=True)
