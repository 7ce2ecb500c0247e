"""``StructuredSpec``: what one request's output must match, parsed from vLLM's structured-outputs object.

vLLM's ``SamplingParams`` carries the constraint as an object, ``structured_outputs``
(``StructuredOutputsParams``, vLLM >= 0.10.2) or ``guided_decoding`` (``GuidedDecodingParams``, older vLLM;
what Triton's vLLM backend builds from ``sampling_parameters``). Both have the same fields; exactly one
constraint is set:

=================  ===========================  ========================================================
field              value                        the output is
=================  ===========================  ========================================================
``json``           JSON schema (object/string)  one JSON value valid under the schema
``json_object``    ``true``                     any JSON object
``regex``          string                       a full match of the regular expression
``choice``         list of strings              exactly one of the strings
``grammar``        EBNF text (GBNF dialect)     a sentence of the grammar, from its ``root`` rule
=================  ===========================  ========================================================

Options accepted next to the constraint: ``disable_any_whitespace`` (JSON without free whitespace between
tokens: the compact form), ``disable_fallback`` (no effect: there is one backend), ``backend``
(``"guidance"``, ``"auto"`` or absent). Anything else (``whitespace_pattern``, ``structural_tag``,
``disable_additional_properties``, an unknown key) is refused by name.

A spec is validated when it is parsed (``parse_structured``): the constraint is turned into an llguidance
grammar and checked without a tokenizer (cheap, milliseconds) so a bad schema, regex or grammar is refused
with the field named, wherever the request is parsed (router, colocated, prefill, decode). The
tokenizer-specific part happens later (``engine.structured.compiler``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import InvalidSamplingParams

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar"]
#: The sampling-parameter keys that carry a structured-outputs object (vLLM's names, newest first).
SPEC_KEYS: tuple[str, ...] = ("structured_outputs", "guided_decoding")
_KINDS: tuple[SpecKind, ...] = ("json", "json_object", "regex", "choice", "grammar")
_BOOL_OPTIONS = ("disable_any_whitespace", "disable_fallback")
_BACKENDS = ("guidance", "auto")
_REFUSED = {"whitespace_pattern": "a custom whitespace pattern is not supported",
            "structural_tag": "structural tags are not supported",
            "disable_additional_properties": "set additionalProperties: false in the schema instead"}


@dataclass(frozen=True)
class StructuredSpec:
    """One request's output constraint; hashable, so it keys the compiled-grammar cache.

    Attributes:
        kind: which constraint (see the module table).
        value: its text in a canonical form: the schema as compact JSON (key order kept) (``json``), ``""``
            (``json_object``), the regex, the choices as a JSON list, or the EBNF grammar.
        any_whitespace: JSON kinds: allow free whitespace between JSON tokens (vLLM's default, true).
    """

    kind: SpecKind
    value: str
    any_whitespace: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The vLLM ``structured_outputs`` object of this spec (what ``parse_structured`` reads back)."""
        value: Any = {"json": lambda: json.loads(self.value), "json_object": lambda: True,
                      "choice": lambda: json.loads(self.value)}.get(self.kind, lambda: self.value)()
        out: dict[str, Any] = {self.kind: value}
        if not self.any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def parse_structured(key: str, raw: Any) -> StructuredSpec | None:
    """Parse and validate the structured-outputs object of sampling parameter ``key``.

    Args:
        key: ``"structured_outputs"`` or ``"guided_decoding"`` (names the errors).
        raw: the object, or its JSON text (genai-perf style string values); None or ``{}`` with every field
            null mean no constraint.
    Returns:
        The spec, or None when no constraint is set.
    Raises:
        InvalidSamplingParams: ``<key>.<field>`` for an unknown or unsupported field, two constraints at once,
            a value of the wrong type, or a schema / regex / grammar llguidance refuses (its message).
    """
    values = _as_object(key, raw)
    set_fields = {k: v for k, v in values.items() if v is not None and v is not False}
    for name in set_fields:
        if name in _REFUSED:
            raise InvalidSamplingParams(f"{key}.{name}", f"not supported by this server: {_REFUSED[name]}")
        if name not in _KINDS and name not in _BOOL_OPTIONS and name != "backend":
            raise InvalidSamplingParams(f"{key}.{name}",
                                        f"unknown field (known: {sorted(_KINDS + _BOOL_OPTIONS)}"
                                        " and backend)")
    backend = set_fields.get("backend")
    if backend is not None and backend not in _BACKENDS:
        raise InvalidSamplingParams(f"{key}.backend", f"must be one of {list(_BACKENDS)}, got {backend!r}")
    for name in _BOOL_OPTIONS:
        if name in set_fields and not isinstance(set_fields[name], bool):
            raise InvalidSamplingParams(f"{key}.{name}", f"must be a bool, got {set_fields[name]!r}")
    kinds = [k for k in _KINDS if k in set_fields]
    if not kinds:
        return None
    if len(kinds) > 1:
        raise InvalidSamplingParams(key, f"set exactly one of {list(_KINDS)}, got {kinds}")
    kind = kinds[0]
    spec = StructuredSpec(kind, _canonical(f"{key}.{kind}", kind, set_fields[kind]),
                          any_whitespace=not set_fields.get("disable_any_whitespace", False))
    validate(spec, f"{key}.{kind}")
    return spec


def validate(spec: StructuredSpec, field_name: str) -> str:
    """``spec``'s llguidance grammar, checked without a tokenizer, to refuse a bad spec early.

    Raises:
        InvalidSamplingParams: ``field_name`` with llguidance's message.
    """
    from llguidance import LLMatcher

    try:
        grammar = to_grammar(spec)
    except Exception as e:  # llguidance raises ValueError / RuntimeError while building some grammars
        raise InvalidSamplingParams(field_name, f"cannot be compiled: {first_line(e)}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidSamplingParams(field_name, f"cannot be compiled: {first_line(error)}")
    return grammar


def to_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar (its JSON text) of ``spec``. Raises what llguidance raises for some bad specs;
    others give a grammar that ``LLMatcher.validate_grammar`` reports."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind in ("json", "json_object"):
        options: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
        if not spec.any_whitespace:
            options.update(item_separator=",", key_separator=":")
        schema = spec.value if spec.kind == "json" else '{"type": "object"}'
        return LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return grammar_from("choice", spec.value)
    return grammar_from("grammar", spec.value)  # GBNF (root ::= ...) or Lark (start: ...)


def first_line(error: object) -> str:
    """The first non-empty line of an error or message."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _as_object(key: str, raw: Any) -> Mapping[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidSamplingParams(key, f"malformed JSON: {e}") from None
    if not isinstance(raw, Mapping):
        raise InvalidSamplingParams(key, f"must be an object, got {type(raw).__name__}")
    return raw


def _canonical(field_name: str, kind: SpecKind, value: Any) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidSamplingParams(field_name, f"malformed JSON schema: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidSamplingParams(field_name,
                                        f"must be a JSON schema object, got {type(value).__name__}")
        return json.dumps(value, separators=(",", ":"))  # key order kept: it is the output's field order
    if kind == "json_object":
        if value is not True:
            raise InvalidSamplingParams(field_name, f"must be true, got {value!r}")
        return ""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidSamplingParams(field_name,
                                        f"must be a non-empty list of non-empty strings, got {value!r}")
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise InvalidSamplingParams(field_name, f"must be a non-empty string, got {value!r}")
    return value
