"""``frontend.schema.closed``: object schemas that list their properties are closed to them (nested, in
arrays, ``anyOf`` branches and ``$defs``), never where the schema decides about other properties itself or
combines object schemas; what the closed schema accepts the original accepts too. ``compile_error``: the
server's verdict on a constraint, None when it compiles."""

from __future__ import annotations

import pytest

from frontend.schema import closed, compile_error

jsonschema = pytest.importorskip("jsonschema")

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x"]}


def test_objects_that_list_properties_are_closed_everywhere() -> None:
    schema = {"type": "object", "properties": {
        "point": POINT, "points": {"type": "array", "items": {"$ref": "#/$defs/P"}},
        "either": {"anyOf": [POINT, {"type": "string"}]}}, "$defs": {"P": POINT}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["point"]["additionalProperties"] is False
    assert out["$defs"]["P"]["additionalProperties"] is False
    assert out["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in POINT  # inputs unchanged
    good = {"point": {"x": 1}, "points": [{"x": 1, "y": 2}], "either": "s"}
    jsonschema.validate(good, out)
    jsonschema.validate(good, schema)
    for bad in ({**good, "extra": 1}, {**good, "point": {"x": 1, "type": "object"}}):
        jsonschema.validate(bad, schema)   # the original allows it, the closed one (strict mode) not
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, out)


@pytest.mark.parametrize("schema", [
    {"type": "object"},                                                          # any object
    {**POINT, "additionalProperties": True},
    {**POINT, "additionalProperties": {"type": "string"}},
    {**POINT, "patternProperties": {"^z": {"type": "string"}}},
    {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x", "z"]},   # z not listed
])
def test_objects_that_decide_about_other_properties_stay_as_written(schema: dict) -> None:
    assert closed(schema) == schema


@pytest.mark.parametrize("schema", [
    {"allOf": [POINT, {"type": "object", "properties": {"z": {"type": "string"}}}]},
    {**POINT, "anyOf": [{"properties": {"z": {"type": "string"}}}, {"required": ["y"]}]},
    {"$defs": {"P": POINT}, "properties": {"p": {"$ref": "#/$defs/P", "properties": {"z": {}}}}},
])
def test_schemas_that_combine_object_schemas_stay_as_written(schema: dict) -> None:
    assert closed(schema) == schema


def test_compile_error_is_the_servers_verdict() -> None:
    assert compile_error({"json": POINT, "disable_any_whitespace": True}) is None
    assert compile_error({"json_object": True}) is None
    error = compile_error({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}})
    assert error is not None and "/nowhere" in error
    assert "uniqueItems" in (compile_error({"json": {"type": "array", "uniqueItems": True}}) or "")
