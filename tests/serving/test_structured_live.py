"""Structured outputs live, on pd_ensemble (PD over NIXL) and colocated in one tritonserver.

Invariants: vLLM's ``structured_outputs`` / ``guided_decoding`` objects in ``sampling_parameters`` hold every
output to its constraint (JSON schemas with nested objects, enums, arrays, bounded numbers and required
fields, validated with ``jsonschema``; regex full match; choice membership; an EBNF grammar); pd_ensemble's
text equals colocated's under each constraint, greedy and seeded (the first token is sampled on prefill under
the grammar and replayed into decode's grammar state); a schema that cannot compile fails its own request with
an error naming the field, while another request streams on undisturbed.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest
from test_llm_api_live import infer

pytestmark = pytest.mark.live
jsonschema = pytest.importorskip("jsonschema")

TRITON_MODELS = ("pd_ensemble", "prefill", "decode", "colocated")
PATHS = ("pd_ensemble", "colocated")
READY_TIMEOUT_S = 600.0  # four engines load slowly on a loaded 2-core host
ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                      "tier": {"type": "string", "enum": ["gold", "silver"]}},
                     "required": ["name", "tier"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "properties": {
                      "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                      "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["sku", "quantity"]}},
        "total": {"type": "number", "minimum": 0, "maximum": 1000},
    },
    "required": ["customer", "items", "total"],
}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "population_millions": {
                                             "type": "number", "minimum": 0, "maximum": 50},
                                         "country": {"type": "string", "enum": ["France", "Spain", "Italy"]}},
        "required": ["city", "population_millions", "country"]}
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("order", {"json": ORDER}, "Write a small shop order as JSON."),
    ("city", {"json": CITY}, "Describe Paris as JSON."),
    ("object", {"json_object": True}, "Give the capital of France as a JSON object with a key city."),
    ("regex", {"regex": r"[0-9]{3}-[0-9]{4}"}, "Make up a phone number."),
    ("choice", {"choice": ["positive", "negative", "neutral"]}, "Sentiment of 'I love it'?"),
    ("grammar", {"grammar": 'root ::= "Answer: " ("yes" | "no")'}, "Is water wet?"),
]


def check(constraint: dict[str, Any], text: str) -> None:
    kind, value = next(iter(constraint.items()))
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    elif kind == "choice":
        assert text in value, text
    else:
        assert text in ("Answer: yes", "Answer: no"), text


def run(url: str, model: str, prompt: str, constraint: dict[str, Any], key: str = "structured_outputs",
        **sampling: Any) -> tuple[str, str]:
    params = {"max_tokens": 200, "temperature": 0, key: constraint, **sampling}
    res = infer(url, model, prompt, params, apply_chat_template=True, return_finish_reason=True)
    assert res.error is None, res.error
    return res.text(), res.outputs[-1]["finish_reason"][0].decode()


@pytest.mark.parametrize("name, constraint, prompt", CASES, ids=[c[0] for c in CASES])
def test_outputs_hold_and_pd_equals_colocated(triton_server, name, constraint, prompt) -> None:
    texts = {}
    for model in PATHS:
        text, finish = run(triton_server.grpc_url, model, prompt, constraint)
        assert finish == "stop", (model, text)
        check(constraint, text)
        texts[model] = text
    assert texts["pd_ensemble"] == texts["colocated"]


@pytest.mark.parametrize("name, constraint, prompt", [CASES[1], CASES[3]], ids=["city", "regex"])
def test_seeded_pd_equals_colocated_with_the_older_key(triton_server, name, constraint, prompt) -> None:
    runs = [run(triton_server.grpc_url, model, prompt, constraint, key="guided_decoding", temperature=0.9,
                seed=5) for model in PATHS]
    assert runs[0] == runs[1]
    check(constraint, runs[0][0])


@pytest.mark.parametrize("model", PATHS)
def test_a_bad_schema_fails_alone_while_another_request_streams(triton_server, model) -> None:
    long_result: dict[str, Any] = {}

    def long_request() -> None:
        long_result["res"] = infer(triton_server.grpc_url, model, "Tell me a story.",
                                   {"max_tokens": 48, "temperature": 0, "ignore_eos": True,
                                    "structured_outputs": {"regex": "[a-z ]+"}})

    worker = threading.Thread(target=long_request, name="long-request")
    worker.start()
    for bad, field in [({"json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}},
                        "structured_outputs.json"),
                       ({"regex": "(unclosed"}, "structured_outputs.regex"),
                       ({"grammar": "root ::= nowhere"}, "structured_outputs.grammar")]:
        res = infer(triton_server.grpc_url, model, "Hi", {"max_tokens": 4, "structured_outputs": bad})
        assert res.error is not None and f"sampling_parameters.{field}" in res.error, res.error
    worker.join(timeout=300)
    res = long_result["res"]
    assert res.error is None and re.fullmatch("[a-z ]+", res.text()) and len(res.text()) > 0, res.text()
