"""JSON schemas as the front hands them to the grammar: objects closed to their listed properties, and a
check that a constraint compiles before the request is sent.

Closing: a JSON schema allows properties it does not list unless it says ``additionalProperties: false``,
and a small model fills that room (SmolLM2-135M copied the tool's schema into its arguments,
``"type":"object","properties":...``, until ``max_tokens``). xgrammar's ``strict_mode`` (its default, and so
vLLM's and SGLang's default backend's) generates only the listed properties; ``closed`` does the same for
llguidance by adding ``additionalProperties: false`` to every object schema that lists ``properties`` and
says nothing about others. The output is still valid under the original schema (closing only narrows it).
Left as written: objects with ``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``,
``propertyNames``, ``dependentSchemas`` or ``if``; objects whose ``required`` names a property they do not
list; objects without ``properties`` (``{"type": "object"}`` means any object); and a whole schema where
object schemas combine: a multi-branch ``allOf``, or ``properties`` next to ``allOf`` / ``anyOf`` /
``oneOf`` / ``$ref`` (closing each part would refuse the other parts' properties).
"""

from __future__ import annotations

import functools
import json
from typing import Any

#: Keys whose value is a map of names to subschemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
#: Keys whose value is data (or names), never a subschema.
_DATA_KEYS = ("enum", "const", "required", "default", "examples", "description", "title", "pattern", "format")
#: An object that says any of these decides itself which other properties it allows.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames",
              "dependentSchemas", "if")


def closed(schema: Any) -> Any:
    """``schema`` with every object schema that lists its ``properties`` closed to them (module docstring);
    a new value, ``schema`` is not changed. Anything that is not a JSON schema object comes back as it is."""
    if not isinstance(schema, dict) or _combines_objects(schema):
        return schema
    return _close(schema)


def _close(node: Any) -> Any:
    if isinstance(node, list):
        return [_close(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _close(sub) for name, sub in value.items()}
        else:
            out[key] = _close(value)
    properties = node.get("properties")
    required = node.get("required", [])
    if isinstance(properties, dict) and not any(k in node for k in _OPEN_KEYS) \
            and isinstance(required, list) and set(required) <= set(properties):
        out["additionalProperties"] = False
    return out


def _combines_objects(node: Any) -> bool:
    if isinstance(node, list):
        return any(_combines_objects(item) for item in node)
    if not isinstance(node, dict):
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return True
    if "properties" in node and any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref")):
        return True
    return any(_combines_objects(v) for k, v in node.items() if k not in _DATA_KEYS)


def compile_error(constraint: dict[str, Any]) -> str | None:
    """Why the server would refuse ``constraint`` (a ``structured_outputs`` object), or None when it compiles.

    The server's own check (``engine.structured.spec.parse_structured``: llguidance's grammar, validated
    without a tokenizer, milliseconds; the last 256 answers are remembered), run here so that the error can
    name the OpenAI field the client sent.
    """
    return _compile_error(json.dumps(constraint, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _compile_error(constraint_json: str) -> str | None:
    from engine.errors import InvalidSamplingParams
    from engine.structured.spec import parse_structured

    try:
        parse_structured("structured_outputs", constraint_json)
    except InvalidSamplingParams as e:
        return e.reason
    return None
