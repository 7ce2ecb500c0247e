"""Tool calling for a model whose chat template has no tool syntax (SmolLM2's): a documented JSON format.

The tools are described to the model in the system message (``system_prompt``); a call is the whole answer,
one JSON object::

    {"tool_calls": [{"name": "<function name>", "arguments": {<arguments object>}}, ...]}

``tool_choice`` decides how that is enforced:

=====================  ==============================================================================
``"none"``             tools are not described; the answer is text
``"auto"`` (default)   tools are described; the answer is free; an answer that is such an object naming
                       declared tools becomes ``tool_calls`` (finish reason ``tool_calls``), else content
``"required"``         the answer is constrained (JSON schema, ``call_schema``) to that object: one or more
                       calls (the model closes the list), exactly one with ``parallel_tool_calls: false``;
                       each names a declared tool, its arguments valid under its ``parameters``
named function         the same, with that one function, exactly one call (OpenAI's "call exactly one
                       specific function"; vLLM and SGLang constrain it so too)
=====================  ==============================================================================

The arguments' schema is closed to the properties it lists (``frontend.schema.closed``): without that,
SmolLM2-135M copied the tool's schema into its arguments and repeated calls until ``max_tokens``.

An answer cut short (``max_tokens``, a stop string) in the middle of a call is a truncated call
(``truncated_calls``): the calls complete before the cut, never a half-parsed one, and no text content.

Earlier turns go back to the template as text: an assistant message's ``tool_calls`` as the JSON object above,
a ``tool`` message as a ``tool`` turn holding its content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from frontend.errors import bad_request, unsupported
from frontend.schema import closed

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one chat request and how the answer may use them.

    Attributes:
        functions: the declared functions, ``{"name", "description", "parameters"}`` each, in request order.
        mode: ``tool_choice`` (a named function gives ``"named"``).
        named: the function ``tool_choice`` names (mode ``"named"``), else None.
        parallel: more than one call per answer allowed (``parallel_tool_calls``, default true).
    """

    functions: tuple[dict[str, Any], ...]
    mode: ToolMode
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """True when the answer must be a tool call (``required`` or a named function)."""
        return self.mode in ("required", "named")

    @property
    def max_calls(self) -> int | None:
        """Most calls in one answer: 1 for a named function or ``parallel_tool_calls: false``, else None."""
        return 1 if self.mode == "named" or not self.parallel else None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice``; None when the request has no tools.

    Raises:
        OpenAIError: 400 naming ``tools[i]...`` or ``tool_choice`` (not a function tool, no name, a choice
            naming an undeclared function, ``tool_choice`` other than none without tools).
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = tuple(_function(i, tool) for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be distinct", "tools")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(functions, tool_choice or "auto", None, parallel)  # type: ignore[arg-type]
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = ((tool_choice.get("function") or {}).get("name")
                if isinstance(tool_choice.get("function"), dict) else None)
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools {names}",
                              "tool_choice")
        return ToolPlan(functions, "named", name, parallel)
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")


def _function(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise unsupported(f"tools[{index}].type", "only function tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request("a function tool needs function.name", f"tools[{index}].function.name")
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request("function.parameters must be a JSON schema object",
                          f"tools[{index}].function.parameters")
    return {"name": fn["name"], "description": fn.get("description") or "", "parameters": parameters}


def system_prompt(plan: ToolPlan) -> str:
    """The text that describes the tools and the call format to the model (appended to the system message)."""
    lines = ["You can call these functions (name, description, JSON schema of the arguments):"]
    lines += [json.dumps(f, ensure_ascii=False) for f in plan.functions]
    lines.append('To call functions, answer with only this JSON object: {"tool_calls": [{"name": '
                 '<function name>, "arguments": <arguments object>}]}. Otherwise answer in plain text.')
    return "\n".join(lines)


def forced_functions(plan: ToolPlan) -> list[tuple[int, dict[str, Any]]]:
    """The functions a constrained answer may call, with their index in ``tools``."""
    return [(i, f) for i, f in enumerate(plan.functions) if plan.mode != "named" or f["name"] == plan.named]


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema a constrained answer must follow (``required`` / named): the call object, at least one
    call, at most ``plan.max_calls``, each call's arguments closed to the properties its schema lists."""
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, "arguments": closed(f["parameters"])},
              "required": ["name", "arguments"], "additionalProperties": False}
             for _, f in forced_functions(plan)]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if plan.max_calls is not None:
        array["maxItems"] = plan.max_calls
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}


def parse_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` of an answer: ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]`` (``arguments`` a JSON string); None when ``text`` is not a call of declared tools (then
    it is content)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = value.get("tool_calls") if isinstance(value, dict) else None
    if not isinstance(calls, list) or not calls or not all(_is_call(c, plan) for c in calls):
        return None
    return _openai_calls(calls[:plan.max_calls] if plan.max_calls else calls)


#: The start of the call object, whitespace aside: ``{"tool_calls":[``.
_CALL_HEAD = '{"tool_calls":['
_CALL_HEAD_RE = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')


def truncated_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """For an answer cut short inside the call object (``text`` is not a whole JSON value but begins as one,
    or is a beginning of ``{"tool_calls":[``): the calls complete before the cut, in ``parse_calls``' shape
    (maybe ``[]``; never a half-parsed one). None when ``text`` is no such beginning (then it is content)."""
    head = _CALL_HEAD_RE.match(text)
    if head is None:
        compact = "".join(text.split())
        return [] if compact and _CALL_HEAD.startswith(compact) else None
    try:
        json.loads(text)
        return None   # a whole value: not cut short (parse_calls decides whether it is a call)
    except json.JSONDecodeError:
        pass
    decoder, pos, calls = json.JSONDecoder(), _skip_space(text, head.end()), []
    while True:
        try:
            call, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if not _is_call(call, plan):
            break
        calls.append(call)
        pos = _skip_space(text, pos)
        if not text.startswith(",", pos):
            break
        pos = _skip_space(text, pos + 1)
    return _openai_calls(calls[:plan.max_calls] if plan.max_calls else calls)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _is_call(call: Any, plan: ToolPlan) -> bool:
    names = {f["name"] for f in plan.functions}
    return isinstance(call, dict) and call.get("name") in names \
        and isinstance(call.get("arguments", {}), dict)


def _openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"],
                          "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
            for c in calls]


@dataclass(frozen=True)
class Answer:
    """One choice's whole answer as OpenAI reports it: ``content`` (None: none), ``tool_calls`` (None: none;
    in ``parse_calls``' shape), ``finish_reason``."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None


def answer_of(text: str, finish_reason: str | None, plan: ToolPlan | None) -> Answer:
    """The answer of a choice's whole ``text`` and the engine's ``finish_reason``: a call → its calls, finish
    reason ``tool_calls``; a call cut short → the calls completed before the cut (None if none), the engine's
    finish reason (``length`` for ``max_tokens``), no content; anything else, or no tools (``none``) → the
    text as content."""
    if plan is None or plan.mode == "none":
        return Answer(text, None, finish_reason)
    calls = parse_calls(text, plan)
    if calls is not None:
        return Answer(None, calls, "tool_calls")
    cut = truncated_calls(text, plan)
    if cut is not None:
        return Answer(None, cut or None, finish_reason)
    return Answer(text, None, finish_reason)


def history_text(tool_calls: list[dict[str, Any]]) -> str:
    """An earlier assistant turn's OpenAI ``tool_calls`` as the call object the model writes."""
    calls = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise bad_request("an assistant tool call needs function.name and function.arguments", "messages")
        arguments = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise bad_request("tool call arguments must be a JSON string", "messages") from None
        calls.append({"name": fn.get("name"), "arguments": parsed})
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)
