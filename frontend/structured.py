"""A chat request's output constraint: ``response_format`` and constrained tool calls →
``structured_outputs``.

``response_format``: ``text`` (or absent) → no constraint; ``json_object`` → ``{"json_object": true}``;
``json_schema`` → ``{"json": <json_schema.schema, closed>}`` (``strict`` or not: the output always follows
the schema; objects are closed to the properties they list, ``frontend.schema.closed``; OpenAI's strict
schemas, and the SDK's from pydantic models, say ``additionalProperties: false`` themselves).
``tool_choice`` ``required`` or a named function → ``{"json": tools.call_schema(plan)}``. Both at once (a
response format and a forced tool call) are refused: an answer cannot be both.

Whitespace (the request's ``whitespace``, an extension): ``"compact"`` (default) adds
``"disable_any_whitespace": true``, JSON with no whitespace between its tokens (llguidance's
``whitespace_flexible`` off, xgrammar's ``any_whitespace=False``): a small model otherwise spends its
tokens on newlines and indentation (SmolLM2-135M wrote ``{\\n\\n"steps"\\n\\n:\\n\\n[`` until
``max_tokens``); ``"flexible"`` allows any JSON whitespace between tokens (vLLM's default). Whitespace
inside strings is the model's.

The object goes to the server in ``sampling_parameters.structured_outputs`` (vLLM's name). It is compiled
here first (``frontend.schema.compile_error``, the server's own check) so that a schema the server cannot
compile is a 400 naming the field the client sent: ``response_format`` or ``tools[i].function.parameters``.
"""

from __future__ import annotations

from typing import Any, Literal

from frontend.errors import bad_request, unsupported
from frontend.protocol import ResponseFormat
from frontend.schema import closed, compile_error
from frontend.tools import ToolPlan, call_schema, forced_functions

Whitespace = Literal["compact", "flexible"]


def chat_constraint(response_format: ResponseFormat | None, plan: ToolPlan | None,
                    whitespace: Whitespace | None = None) -> dict[str, Any] | None:
    """The ``structured_outputs`` object of a chat request, or None.

    Args:
        response_format: the request's ``response_format``.
        plan: its tools (``frontend.tools.plan_tools``), None without tools.
        whitespace: JSON whitespace (module docstring); None is ``"compact"``.
    Raises:
        OpenAIError: 400 naming ``response_format`` (an unknown type, ``json_schema`` without a schema object,
            a schema that does not compile, a response format next to a forced tool call) or
            ``tools[i].function.parameters`` (a forced function's schema that does not compile).
    """
    forced = plan is not None and plan.constrained
    kind = "text" if response_format is None else response_format.type
    if kind != "text" and forced:
        raise unsupported("response_format", "together with tool_choice 'required' or a named function")
    if forced:
        assert plan is not None
        return _checked_tools(plan, _with_whitespace({"json": call_schema(plan)}, whitespace))
    if kind == "text":
        return None
    if kind == "json_object":
        return _with_whitespace({"json_object": True}, whitespace)
    if kind == "json_schema":
        assert response_format is not None
        spec = response_format.json_schema or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        constraint = _with_whitespace({"json": closed(schema)}, whitespace)
        error = compile_error(constraint)
        if error is not None:
            raise bad_request(f"response_format.json_schema.schema: {error}", "response_format")
        return constraint
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      "response_format.type")


def _with_whitespace(constraint: dict[str, Any], whitespace: Whitespace | None) -> dict[str, Any]:
    return constraint if whitespace == "flexible" else {**constraint, "disable_any_whitespace": True}


def _checked_tools(plan: ToolPlan, constraint: dict[str, Any]) -> dict[str, Any]:
    """``constraint`` (the forced call's), or the 400 of the first forced function whose arguments' schema
    does not compile."""
    error = compile_error(constraint)
    if error is None:
        return constraint
    for index, function in forced_functions(plan):
        own = compile_error({"json": closed(function["parameters"])})
        if own is not None:
            field = f"tools[{index}].function.parameters"
            raise bad_request(f"{field}: {own}", field)
    raise bad_request(f"tools: {error}", "tools")
