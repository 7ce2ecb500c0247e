"""An OpenAI-compatible HTTP front for the models of this repository, in its own process.

``python -m frontend --grpc-url 127.0.0.1:8001 --model pd_ensemble`` serves ``POST /v1/completions``,
``POST /v1/chat/completions`` (SSE streaming or not), ``GET /v1/models`` and ``GET /health`` and speaks
tritonclient gRPC streaming to one Triton model (``pd_ensemble``, ``colocated``) of one tritonserver, so it
scales apart from the servers. Triton-free: it needs only the client library and the model's tokenizer.

Modules, each with one job:

* ``config``: ``FrontendConfig`` (frozen), built once from the command line.
* ``protocol``: the OpenAI request and response bodies (pydantic).
* ``errors``: ``OpenAIError`` (status + OpenAI error body) and the mapping of Triton error messages to it.
* ``wire``: the backend request/response dataclasses and the Triton LLM-convention contract (pure).
* ``mapping``: OpenAI request → backend request, backend responses → OpenAI bodies and chunks (pure).
* ``chat``: renders chat messages with the model's own chat template.
* ``backend``: the ``Backend`` Protocol and ``TritonGrpcBackend`` (tritonclient.grpc.aio streaming).
* ``app``: the FastAPI application (routes, SSE, client-disconnect cancellation).
"""
