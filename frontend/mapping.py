"""OpenAI requests → ``BackendRequest``, backend responses → OpenAI bodies and stream chunks. Pure functions.

Request mapping: ``max_tokens`` (chat: ``max_completion_tokens`` first) → ``max_tokens`` (absent: completions
16, as OpenAI; chat ``FrontendConfig.default_max_tokens``, because the server reserves KV pages for prompt +
max_tokens up front); ``temperature`` (absent: 1.0, OpenAI's default), ``top_p``, ``seed``, ``stop``, ``n``
(> 1 only), penalties (non-neutral only), ``logit_bias`` and vLLM's extensions pass through; completions
``logprobs: k`` and chat ``logprobs: true`` + ``top_logprobs: k`` → ``logprobs: k``. Only keys the client set
are sent, so a server that predates a key still serves every request that does not use it. Chat
``response_format`` and forced tool calls become ``structured_outputs`` (``frontend.structured``); tools are
described in the system message and answers parsed back into ``tool_calls`` (``frontend.tools``); an answer
cut short inside a call keeps its finish reason (``length``) and only the calls completed before the cut,
never the call object as content.
"""

from __future__ import annotations

from collections.abc import Sequence

from frontend import tools
from frontend.errors import bad_request, unsupported
from frontend.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SamplingFields,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from frontend.structured import chat_constraint
from frontend.tool_stream import ToolCallStream
from frontend.wire import BackendResponse, JSONValue, TokenLogprob, Totals

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
_PASSTHROUGH = ("top_p", "seed", "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids",
                "include_stop_str_in_output")
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def sampling_parameters(req: SamplingFields, max_tokens: int, logprobs: int | None) -> dict[str, JSONValue]:
    """The ``sampling_parameters`` JSON object of a request (module docstring). Raises OpenAIError (400)
    for a ``logit_bias`` key that is not a token id."""
    params: dict[str, JSONValue] = {"max_tokens": max_tokens,
                                    "temperature": 1.0 if req.temperature is None else req.temperature}
    for name in _PASSTHROUGH:
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name)
        if value is not None and value != neutral:
            params[name] = value
    if req.stop:
        params["stop"] = req.stop
    if req.n > 1:
        params["n"] = req.n
    if req.logit_bias:
        params["logit_bias"] = _logit_bias(req.logit_bias)
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


def _logit_bias(bias: dict[str, float]) -> dict[str, float]:
    for key, value in bias.items():
        if not key.strip().lstrip("-").isdigit() or int(key) < 0:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
    return {str(int(k)): float(v) for k, v in bias.items()}


def _check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def completion_prompt(req: CompletionRequest) -> str:
    """The one prompt of a completion request. Raises OpenAIError (400) naming an unsupported field."""
    _check_stream_options(req)
    if req.echo:
        raise unsupported("echo")
    if req.suffix:
        raise unsupported("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of", "only best_of == n")
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if len(prompts) != 1:
        raise unsupported("prompt", "exactly one prompt string per request")
    if not prompts[0]:
        raise bad_request("prompt must not be empty", "prompt")
    return prompts[0]


def completion_sampling(req: CompletionRequest) -> dict[str, JSONValue]:
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return sampling_parameters(req, max_tokens, req.logprobs)


def tool_plan(req: ChatCompletionRequest) -> tools.ToolPlan | None:
    """The request's tools and ``tool_choice`` (None without tools). Raises OpenAIError (400)."""
    return tools.plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


def chat_messages(req: ChatCompletionRequest, plan: tools.ToolPlan | None = None) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` dicts for the chat template (``developer`` → ``system``; text
    parts joined; earlier tool calls and tool results as text, the tools described in the system message
    unless ``tool_choice`` is none). Raises OpenAIError (400) naming an unsupported field."""
    _check_stream_options(req)
    for name in ("functions", "audio", "prediction", "reasoning_effort"):
        if getattr(req, name):
            raise unsupported(name)
    if req.modalities not in (None, ["text"]):
        raise unsupported("modalities", "only ['text']")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    if plan is not None and plan.mode != "none":
        described = tools.system_prompt(plan)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}
        else:
            messages.insert(0, {"role": "system", "content": described})
    return messages


def _message(index: int, message: ChatMessage) -> dict[str, str]:
    where = f"messages[{index}]"
    if message.role == "function":
        raise unsupported(f"{where}.role", "'function' (use 'tool')")
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        return {"role": "assistant", "content": tools.history_text(message.tool_calls)}
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise unsupported(f"{where}.content", "only text content parts")
        content = "".join(part.text or "" for part in content)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content or ""}


def chat_sampling(req: ChatCompletionRequest, default_max_tokens: int,
                  plan: tools.ToolPlan | None = None) -> dict[str, JSONValue]:
    """The chat request's ``sampling_parameters``, with ``structured_outputs`` when its answer is constrained.
    Raises OpenAIError (400) as ``sampling_parameters`` and ``chat_constraint``."""
    max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_parameters(req, max_tokens, top)
    constraint = chat_constraint(req.response_format, plan, req.whitespace)
    if constraint is not None:
        params["structured_outputs"] = constraint
    return params


def usage_of(totals: Totals) -> Usage:
    """``usage`` from the prompt's tokens and the summed new tokens of every sample; ``prompt_tokens_details``
    with the prompt's cached tokens (once, like ``prompt_tokens``) when the server reports them."""
    completion = totals.num_output_tokens
    cached = totals.num_cached_tokens
    return Usage(prompt_tokens=totals.num_input_tokens, completion_tokens=completion,
                 total_tokens=totals.num_input_tokens + completion,
                 prompt_tokens_details=None if cached is None else PromptTokensDetails(cached_tokens=cached))


# ---- logprobs --------------------------------------------------------------------------------------------

def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int = 0) -> CompletionLogprobs:
    """Legacy ``logprobs`` of ``tokens``; ``text_offset``: characters of the choice's text before them."""
    out = CompletionLogprobs()
    for token in tokens:
        out.tokens.append(token.token)
        out.token_logprobs.append(token.logprob)
        out.top_logprobs.append(dict(token.top))
        out.text_offset.append(text_offset)
        text_offset += len(token.token)
    return out


def chat_logprobs(tokens: Sequence[TokenLogprob], top_k: int) -> ChatLogprobs:
    """Chat ``logprobs.content`` of ``tokens``, each with its best ``top_k`` alternatives."""
    def utf8(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    return ChatLogprobs(content=[
        ChatTokenLogprob(token=t.token, logprob=t.logprob, bytes=utf8(t.token),
                         top_logprobs=[TopLogprob(token=s, logprob=lp, bytes=utf8(s))
                                       for s, lp in t.top[:top_k]])
        for t in tokens])


# ---- whole answers ---------------------------------------------------------------------------------------

def completion_response(totals: Totals, request_id: str, created: int, model: str,
                        want_logprobs: bool) -> CompletionResponse:
    choices = [CompletionChoice(index=i, text="".join(s.text), finish_reason=s.finish_reason,
                                logprobs=completion_logprobs(s.logprobs) if want_logprobs else None)
               for i, s in enumerate(totals.samples)]
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                              usage=usage_of(totals))


def chat_response(totals: Totals, request_id: str, created: int, model: str,
                  top_logprobs: int | None, plan: tools.ToolPlan | None = None) -> ChatCompletionResponse:
    """The whole chat answer; with tools (not ``none``), an answer that is a tool call becomes ``tool_calls``
    (content null, finish reason ``tool_calls``), one cut short keeps only its complete calls
    (``tools.answer_of``)."""
    choices = []
    for i, s in enumerate(totals.samples):
        answer = tools.answer_of("".join(s.text), s.finish_reason, plan)
        message = AssistantMessage(content=answer.content, tool_calls=None if answer.tool_calls is None else
                                   [ToolCall.model_validate(c) for c in answer.tool_calls])
        choices.append(ChatChoice(index=i, message=message, finish_reason=answer.finish_reason,
                                  logprobs=(None if top_logprobs is None
                                            else chat_logprobs(s.logprobs, top_logprobs))))
    return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage_of(totals))


# ---- stream chunks ---------------------------------------------------------------------------------------

def chat_role_chunk(n: int, request_id: str, created: int, model: str) -> ChatCompletionChunk:
    """The first chunk of a chat stream: the assistant role for every choice."""
    return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)])


def chat_chunk(response: BackendResponse, request_id: str, created: int, model: str,
               top_logprobs: int | None, calls: ToolCallStream | None = None) -> ChatCompletionChunk | None:
    """The chunk of one backend response: the choices it changed; None when it changed none. ``calls``: the
    request's tool-call filter (text held back while it may be a tool call; ``frontend.tool_stream``)."""
    choices = []
    for d in response.samples:
        if not (d.text or d.finish_reason or d.logprobs):
            continue
        logprobs = None if top_logprobs is None else chat_logprobs(d.logprobs, top_logprobs)
        if calls is None:
            delta, finish = ChatDelta(content=d.text), d.finish_reason
        else:
            out = calls.feed(d.index, d.text, d.finish_reason)
            tool_calls = (None if out.tool_calls is None
                          else [ToolCallDelta.model_validate(c) for c in out.tool_calls])
            delta, finish = ChatDelta(content=out.content, tool_calls=tool_calls), out.finish_reason
            if out.content is None and tool_calls is None and finish is None and logprobs is None:
                continue
        choices.append(ChatChunkChoice(index=d.index, delta=delta, finish_reason=finish, logprobs=logprobs))
    return (ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices)
            if choices else None)


def completion_chunk(response: BackendResponse, request_id: str, created: int, model: str,
                     want_logprobs: bool, text_offsets: list[int]) -> CompletionChunk | None:
    """The chunk of one backend response; ``text_offsets[i]``: characters choice ``i`` streamed so far
    (updated here). None when the response changed no choice."""
    choices = []
    for d in response.samples:
        if not (d.text or d.finish_reason or d.logprobs):
            continue
        while len(text_offsets) <= d.index:
            text_offsets.append(0)
        logprobs = completion_logprobs(d.logprobs, text_offsets[d.index]) if want_logprobs else None
        text_offsets[d.index] += len(d.text)
        choices.append(CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason,
                                        logprobs=logprobs))
    return CompletionChunk(id=request_id, created=created, model=model, choices=choices) if choices else None
