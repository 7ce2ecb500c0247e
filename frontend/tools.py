"""Tool calling for a model whose chat template has no tool syntax (SmolLM2's): a documented JSON format.

The tools are described to the model in the system message (``system_prompt``); a call is the whole answer, one
JSON object::

    {"tool_calls": [{"name": "<function name>", "arguments": {<arguments object>}}, ...]}

``tool_choice`` decides how that is enforced:

=====================  ==============================================================================
``"none"``             tools are not described; the answer is text
``"auto"`` (default)   tools are described; the answer is free; an answer that is such an object naming
                       declared tools becomes ``tool_calls`` (finish reason ``tool_calls``), else content
``"required"``         the answer is constrained (JSON schema, ``call_schema``) to that object: one call
                       (``parallel_tool_calls: false``) or one or more, each naming a declared tool
                       with arguments valid under its ``parameters``
named function         the same, with that one function only
=====================  ==============================================================================

Earlier turns go back to the template as text: an assistant message's ``tool_calls`` as the JSON object above,
a ``tool`` message as a ``tool`` turn holding its content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from frontend.errors import bad_request, unsupported

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


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice``; None when the request has no tools.

    Raises:
        OpenAIError: 400 naming ``tools[i]...`` or ``tool_choice`` (not a function tool, no name, a choice naming
            an undeclared function, ``tool_choice`` other than none without tools).
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
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) \
            else None
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice")
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
        raise bad_request("function.parameters must be a JSON schema object", f"tools[{index}].function.parameters")
    return {"name": fn["name"], "description": fn.get("description") or "", "parameters": parameters}


def system_prompt(plan: ToolPlan) -> str:
    """The text that describes the tools and the call format to the model (appended to the system message)."""
    lines = ["You can call these functions (name, description, JSON schema of the arguments):"]
    lines += [json.dumps(f, ensure_ascii=False) for f in plan.functions]
    lines.append('To call functions, answer with only this JSON object: {"tool_calls": [{"name": <function name>, '
                 '"arguments": <arguments object>}]}. Otherwise answer in plain text.')
    return "\n".join(lines)


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema a constrained answer must follow (``required`` / named)."""
    functions = [f for f in plan.functions if plan.mode != "named" or f["name"] == plan.named]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not plan.parallel:
        array["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
            "additionalProperties": False}


def parse_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` of an answer: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
    (``arguments`` a JSON string); None when ``text`` is not a call of declared tools (then it is content)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = value.get("tool_calls") if isinstance(value, dict) else None
    names = {f["name"] for f in plan.functions}
    if not isinstance(calls, list) or not calls:
        return None
    if not all(isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments", {}), dict)
               for c in calls):
        return None
    if not plan.parallel:
        calls = calls[:1]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}}
            for c in calls]


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
