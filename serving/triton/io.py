"""The one module that converts between python-backend objects (``pb_utils``) and ``serving`` dataclasses.

``pb_utils`` (``triton_python_backend_utils``) only exists inside the python backend's stub process, so it is
imported on first use; the numpy halves (``scalars_from_arrays``, ``response_arrays``) work anywhere.

Tensors of the LLM convention: inputs are shape ``[1]`` (or ``[1, 1]``); strings arrive as ``bytes`` in numpy
object arrays, bools as ``np.bool_``. Outputs (the vLLM backend's, ``docs/additional_outputs.md`` there, and
ours): the client layout of ``serving.schema.OUTPUTS``, whose rows give each output's type, dims (``[n]``: one
entry per sample; ``[1]``: one value) and meaning: ``text_output`` always, every other output when its
``return_*`` input asks for it, then on every response.

``logprobs`` JSON of one sample: a list with one object per token of the response,
``{"<token_id>": {"logprob": float, "rank": int, "decoded_token": str}, ...}``: the sampled token first, then
the top ``logprobs`` tokens not already listed (the vLLM backend's layout); ``null`` when the request set no
``logprobs`` sampling parameter.

Child layout (prefill/decode → the router): ``serving.child.codec``.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from engine.outputs import TokenLogprob
from serving.answering import start_or_fail
from serving.child.codec import encode_response
from serving.delta import Delta, ErrorKind, ResponseChunk, merge_chunks
from serving.parsing.arrays import scalars_from_arrays
from serving.parsing.request import (
    INPUT_NAMES,
    GenerateRequest,
    OutputOptions,
    RawValue,
    RequestError,
    parse_request,
)
from serving.schema import CLIENT_OUTPUTS
from serving.triton.response_dispatch import ResponseDispatcher

logger = logging.getLogger(__name__)
#: No optional output asked for (the default of a client request).
NO_OPTIONS = OutputOptions()


def pb_utils() -> ModuleType:
    """The python backend's utility module. Raises ImportError outside a Triton python-backend stub."""
    return importlib.import_module("triton_python_backend_utils")


def read_inputs(request: Any) -> dict[str, RawValue]:
    """The LLM-convention inputs of one ``pb_utils.InferenceRequest`` (absent optional inputs left out).

    Raises:
        RequestError: as ``scalars_from_arrays``.
    """
    pb = pb_utils()
    arrays = {}
    for name in INPUT_NAMES:
        tensor = pb.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return scalars_from_arrays(arrays)


def read_parameters(request: Any) -> dict[str, object]:
    """The Triton parameters of one ``pb_utils.InferenceRequest`` (``parameters()`` is a JSON object text).

    Raises:
        RequestError: ``parameters`` when they are not a JSON object.
    """
    raw = request.parameters()
    try:
        values = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise RequestError("parameters", f"malformed JSON: {e}") from None
    if not isinstance(values, dict):
        raise RequestError("parameters", f"must be a JSON object, got {type(values).__name__}")
    return values


def logprobs_json(entries: tuple[TokenLogprob, ...] | None) -> str:
    """One sample's ``logprobs`` output (see the module docstring); ``"null"`` for None."""
    if entries is None:
        return "null"
    tokens = []
    for e in entries:
        token = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}}
        for rank, (token_id, logprob, text) in enumerate(e.top, start=1):
            token.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text})
        tokens.append(token)
    return json.dumps(tokens)


#: Delta attribute → the text a client BYTES output carries for its value (other attributes: ``str``)
_CLIENT_TEXTS: dict[str, Callable[[Any], str]] = {"logprobs": logprobs_json}
#: Triton data type of a client output → its numpy dtype
_CLIENT_DTYPES: dict[str, Any] = {"TYPE_STRING": np.object_, "TYPE_UINT32": np.uint32,
                                  "TYPE_FP32": np.float32}


def response_arrays(chunk: ResponseChunk, options: OutputOptions = NO_OPTIONS) -> dict[str, np.ndarray]:
    """The output arrays of one client response, by output name: ``text_output`` and what ``options`` asks, as
    ``serving.schema``'s client layout declares them (an output of dims ``[1]`` holds the samples' largest
    value)."""
    arrays = {}
    for output in CLIENT_OUTPUTS.values():
        layout = output.client
        if layout is None or not options.asks(output.name):
            continue
        values = [getattr(s, layout.attribute) for s in chunk.samples]
        if layout.dims == (1,):
            values = [max(values, default=0)]
        if layout.data_type == "TYPE_STRING":
            text = _CLIENT_TEXTS.get(layout.attribute, str)
            values = [text(v).encode("utf-8") for v in values]
        arrays[output.name] = np.array(values, dtype=_CLIENT_DTYPES[layout.data_type])
    return arrays


def inference_response(chunk: ResponseChunk, child: bool = False, options: OutputOptions = NO_OPTIONS) -> Any:
    """``pb_utils.InferenceResponse`` holding ``chunk`` (``child``: its one sample in the prefill/decode
    output layout; else the client layout with the outputs ``options`` asks for)."""
    pb = pb_utils()
    arrays = encode_response(chunk.samples[0] if chunk.samples else Delta()) if child \
        else response_arrays(chunk, options)
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, array) for name, array in arrays.items()])


def child_error_response(message: str, kind: ErrorKind) -> Any:
    """``pb_utils.InferenceResponse`` of a failed child request: a normal response, in the child layout, whose
    ``error`` output holds ``message`` and ``error_kind`` its ``kind``."""
    pb = pb_utils()
    arrays = encode_response(Delta.failure(message, kind))
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, array) for name, array in arrays.items()])


def error_response(message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> Any:
    """``pb_utils.InferenceResponse`` carrying ``message`` as a ``pb_utils.TritonError``: code ``INVALID_ARG``
    for the request's own errors (``ErrorKind.REQUEST``; Triton's HTTP endpoints answer 400), else
    ``INTERNAL`` (500)."""
    pb = pb_utils()
    code = pb.TritonError.INVALID_ARG if kind is ErrorKind.REQUEST else pb.TritonError.INTERNAL
    return pb.InferenceResponse(error=pb.TritonError(message, code))


class RequestTimingSink(Protocol):
    """Where finished requests' timings go (``ServingMetrics``)."""

    def request_timing(self, ttft_s: float | None, e2e_s: float, num_prompt_tokens: int,
                       num_output_tokens: int, tpot_s: float | None) -> None: ...


class TritonResponseSink:
    """``ResponseSink`` over a decoupled request's ``response_sender``, through the instance's
    ``ResponseDispatcher``: the caller's thread (an engine loop, the router's event loop) only queues.

    The FINAL flag is queued exactly once; later calls are dropped (tritonserver 2.51 crashes on a sender
    touched after FINAL, and the dispatcher never does). ``is_cancelled`` reads the dispatcher's cached
    answer.
    """

    def __init__(self, response_sender: Any, dispatcher: ResponseDispatcher, request_id: str = "",
                 child: bool = False, options: OutputOptions = NO_OPTIONS,
                 timing: RequestTimingSink | None = None, child_errors: bool = True) -> None:
        """
        Args:
            response_sender: ``request.get_response_sender()``.
            dispatcher: the model instance's response thread (started).
            request_id: for log lines (the client's request id, may be empty).
            child: the request comes from the router: responses use the child output layout
                (``serving.child.codec.encode_response``), and an error is a normal FINAL response whose
                ``error`` output holds the message instead of a Triton error response (a decoupled BLS
                response iterator never ends after an error response in tritonserver 2.51; over gRPC either
                form works).
            child_errors: with ``child``, errors too in the child layout (the router reads them there); False:
                as a Triton error (HTTP 400 with the message: a client calling prefill/decode directly,
                ``from_router``), the other responses staying in the declared child layout.
            options: client layout: the optional outputs the request asked for (``set_options`` once the
                request is parsed).
            timing: where a finished request's TTFT, TPOT, end-to-end latency and lengths go (measured from
                this sink's creation, i.e. the request's arrival in ``execute``, to when the first text and
                the final response are queued); observed on the response thread, never the caller's.
        """
        self._dispatcher = dispatcher
        self._handle = dispatcher.open(response_sender, request_id)
        self._request_id = request_id
        self._child = child
        self._child_errors = child_errors
        self.options = options
        self._timing = timing
        self._arrival_s = time.monotonic()
        self._first_text_s: float | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once FINAL was queued."""
        return self._closed

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        options = self.options
        observe = self._timing_of(chunk, final)
        child = self._child

        def make(merged: ResponseChunk) -> Any:
            if observe is not None:
                observe()
            return inference_response(merged, child=child, options=options)

        self._queue(lambda: self._dispatcher.submit_chunk(self._handle, chunk, make, final), final)

    def _timing_of(self, chunk: ResponseChunk, final: bool) -> Callable[[], None] | None:
        """The histogram update of this response (run on the response thread), or None."""
        now = time.monotonic()
        if self._first_text_s is None and any(s.text for s in chunk.samples):
            self._first_text_s = now
        timing = self._timing
        if timing is None or not final or any(s.finish_reason == "abort" for s in chunk.samples):
            return None
        first, arrival = self._first_text_s, self._arrival_s
        num_output = sum(s.num_output_tokens for s in chunk.samples)
        # TPOT of one sample: the samples decode side by side, each at its own pace
        per_sample = max(s.num_output_tokens for s in chunk.samples)
        ttft = None if first is None else first - arrival
        tpot = None if first is None or per_sample < 2 else (now - first) / (per_sample - 1)
        return lambda: timing.request_timing(ttft, now - arrival, chunk.num_input_tokens, num_output, tpot)

    def send_error(self, message: str, kind: ErrorKind = ErrorKind.INSTANCE) -> None:
        child = self._child and self._child_errors

        def build() -> Any:
            return child_error_response(message, kind) if child else error_response(message, kind)

        self._queue(lambda: self._dispatcher.submit(self._handle, build, True), True)

    def close(self) -> None:
        self._queue(lambda: self._dispatcher.submit(self._handle, None, True), True)

    def is_cancelled(self) -> bool:
        return self._closed or self._handle.cancelled

    def _queue(self, submit: Callable[[], None], final: bool) -> None:
        """Run ``submit`` (it hands one response to the dispatcher) unless FINAL was queued already: the one
        place that keeps FINAL to once per stream."""
        with self._lock:
            if self._closed:
                logger.warning("request %s: response after FINAL dropped", self._request_id)
                return
            self._closed = final
            submit()


def parse_client_request(request: Any,
                         sink: TritonResponseSink) -> tuple[GenerateRequest, dict[str, RawValue]]:
    """Parse a client request of a public model (``colocated``, ``pd_ensemble``) and set ``sink``'s output
    options from it. Returns the parsed request and its raw inputs.

    Raises:
        RequestError: as ``read_inputs``, ``read_parameters`` and ``parse_request``.
    """
    raw = read_inputs(request)
    parsed = parse_request(raw, read_parameters(request) if "sampling_parameters" not in raw else None)
    sink.options = parsed.outputs
    return parsed, raw


def new_dispatcher(name: str) -> ResponseDispatcher:
    """The response thread of one model instance (not started), with Triton's FINAL flag; a stream that fell
    behind gets its queued responses merged (``merge_chunks``)."""
    return ResponseDispatcher(name, pb_utils().TRITONSERVER_RESPONSE_COMPLETE_FINAL, merge=merge_chunks)


def from_router(request: Any) -> bool:
    """Whether a prefill/decode request comes from a router: it carries ``child_schema`` (every router sends
    it, ``serving.router.launch.child_arrays``) or ``pd_control`` (the router's ``describe``). A request
    without either (a client calling the worker model directly) gets its error as a ``pb_utils.TritonError``
    (HTTP 400 with the message as text), not as bytes in the child's ``error`` output."""
    from serving.child.codec import SCHEMA_INPUT
    from serving.parsing.pd_request import CONTROL_INPUT

    return any(pb_utils().get_input_tensor_by_name(request, name) is not None
               for name in (SCHEMA_INPUT, CONTROL_INPUT))


def answer_each(requests: list[Any], handle: Callable[[Any, TritonResponseSink], None],
                dispatcher: ResponseDispatcher, child: bool = False,
                timing: RequestTimingSink | None = None) -> None:
    """``execute`` of a decoupled model: for each request, a ``TritonResponseSink`` then
    ``handle(request, sink)``.

    A ``RequestError`` (bad input) becomes that request's error response, and so does any other exception
    (logged): every stream ends with FINAL, and one request's failure never reaches another.

    Args:
        requests: the ``pb_utils.InferenceRequest`` list ``execute`` got.
        handle: parses and starts one request; its responses go to the sink.
        dispatcher: the instance's response thread.
        child: the requests come to a prefill/decode model: those from a router (``from_router``) get
            ``TritonResponseSink``'s child layout.
        timing: the public models' latency histograms (``TritonResponseSink``'s ``timing``).
    """
    for request in requests:
        sink = TritonResponseSink(request.get_response_sender(), dispatcher, request.request_id(),
                                  child=child, timing=timing, child_errors=not child or from_router(request))
        start_or_fail(lambda: handle(request, sink), sink, request.request_id())  # noqa: B023 - called at once
