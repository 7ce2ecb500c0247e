"""A chat request's output constraint: ``response_format`` and constrained tool calls → ``structured_outputs``.

``response_format``: ``text`` (or absent) → no constraint; ``json_object`` → ``{"json_object": true}``;
``json_schema`` → ``{"json": <json_schema.schema>}`` (``strict`` or not: the output always follows the schema;
OpenAI's strict schemas, and the SDK's from pydantic models, set ``additionalProperties: false`` themselves). ``tool_choice`` ``required`` or a named
function → ``{"json": tools.call_schema(plan), "disable_any_whitespace": true}`` (compact: a small model
otherwise spends its tokens on whitespace). Both at once (a response format and a forced tool call) are
refused: an answer cannot be both. The object goes to the server in ``sampling_parameters.structured_outputs``
(vLLM's name); the server compiles it and refuses a schema it cannot compile with a 400 naming
``response_format`` or ``tools`` (``frontend.errors.from_triton_message``).
"""

from __future__ import annotations

from typing import Any

from frontend.errors import bad_request, unsupported
from frontend.protocol import ResponseFormat
from frontend.tools import ToolPlan, call_schema


def chat_constraint(response_format: ResponseFormat | None, plan: ToolPlan | None) -> dict[str, Any] | None:
    """The ``structured_outputs`` object of a chat request, or None.

    Raises:
        OpenAIError: 400 naming ``response_format`` (an unknown type, ``json_schema`` without a schema object,
            a response format next to a forced tool call).
    """
    forced = plan is not None and plan.constrained
    kind = "text" if response_format is None else response_format.type
    if kind != "text" and forced:
        raise unsupported("response_format", "together with tool_choice 'required' or a named function")
    if forced:
        assert plan is not None
        return {"json": call_schema(plan), "disable_any_whitespace": True}
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        assert response_format is not None
        spec = response_format.json_schema or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format.json_schema.schema")
        return {"json": schema}
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      "response_format.type")
