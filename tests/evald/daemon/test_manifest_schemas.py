"""The manifest's optional input_schema and result_schema: checked at registration (a bad one
is ``invalid_module`` naming the field, and the daemon keeps serving), carried in
``ListEvaluators`` as JSON text, and read back by the engine adapter's ``EvaluatorSpec``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from daemon_harness import Daemon, outcome

from engine_adapter.spans import EvaluatorSpec
from evald.client import CallError
from evald.contract import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, EvaldError, parse_manifest
from evald.testing import guest, manifest_bytes
from evaluators_wasm import EXAMPLES_DIR, example_path

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "age": {"type": ["integer", "null"]},
        "components": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["age", "components"],
}
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "total": {"type": ["number", "null"]},
        "action": {"enum": ["book_appointment", "escalate_human"]},
    },
}


def policy_manifest(name: str, **changes: Any) -> bytes:
    fields = {"input_schema": INPUT_SCHEMA, "result_schema": RESULT_SCHEMA, **changes}
    return manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1", **fields)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


BAD_SCHEMAS = [
    ("input_schema", ["not", "an", "object"], "must be a JSON Schema object"),
    ("result_schema", {"type": "decimal"}, "not a valid JSON Schema at /type"),
    ("input_schema", {"properties": {"age": {"minimum": "18"}}}, "not a valid JSON Schema"),
    ("result_schema", {"enum": ["x" * 100] * 200}, f"at most {MAX_SCHEMA_BYTES} bytes"),
    ("input_schema", nested(MAX_SCHEMA_DEPTH + 1), f"deeper than {MAX_SCHEMA_DEPTH}"),
]


@pytest.mark.parametrize(("field", "schema", "reason"), BAD_SCHEMAS)
def test_parse_manifest_refuses_a_bad_schema_naming_the_field(
    field: str, schema: Any, reason: str
) -> None:
    with pytest.raises(EvaldError) as info:
        parse_manifest(policy_manifest("policy", **{field: schema}))
    assert info.value.code.value == "invalid_module"
    assert f"manifest field {field}" in info.value.message, info.value.message
    assert reason in info.value.message, info.value.message


def test_parse_manifest_keeps_both_schemas_and_writes_them_back() -> None:
    manifest = parse_manifest(policy_manifest("policy"))
    assert manifest.input_schema == INPUT_SCHEMA
    assert manifest.result_schema == RESULT_SCHEMA
    assert manifest.to_json()["input_schema"] == INPUT_SCHEMA
    assert json.loads(manifest.schema_texts()["result_schema"]) == RESULT_SCHEMA
    plain = parse_manifest(manifest_bytes())
    assert (plain.input_schema, plain.result_schema) == (None, None)
    assert plain.schema_texts() == {"input_schema": "", "result_schema": ""}
    assert "input_schema" not in plain.to_json()


def test_listing_carries_the_schemas_and_the_adapter_reads_them(daemon: Daemon) -> None:
    client = daemon.client("beta")
    client.register(guest("echo", manifest=policy_manifest("schema_policy")), replace=True)
    client.register(guest("echo", manifest=policy_manifest("schema_plain", **{
        "input_schema": ..., "result_schema": ...})), replace=True)  # fmt: skip
    listed = {info.name: info for info in client.list_evaluators()}
    info = listed["schema_policy"]
    assert json.loads(info.input_schema) == INPUT_SCHEMA
    assert json.loads(info.result_schema) == RESULT_SCHEMA
    spec = EvaluatorSpec.from_info(info)
    assert spec.input_schema == INPUT_SCHEMA
    assert spec.result_schema == RESULT_SCHEMA
    assert (listed["schema_plain"].input_schema, listed["schema_plain"].result_schema) == ("", "")
    plain = EvaluatorSpec.from_info(listed["schema_plain"])
    assert (plain.input_schema, plain.result_schema) == (None, None)
    assert listed["calc"].input_schema == ""  # the standard set declares none


@pytest.mark.parametrize(("field", "schema", "reason"), BAD_SCHEMAS[:2])
def test_registration_refuses_a_bad_schema_and_keeps_serving(
    daemon: Daemon, field: str, schema: Any, reason: str
) -> None:
    client = daemon.client("beta")
    with pytest.raises(CallError) as info:
        client.register(guest("echo", manifest=policy_manifest("bad_schema", **{field: schema})))
    assert info.value.code is not None and info.value.code.value == "invalid_module"
    assert f"manifest field {field}" in info.value.message and reason in info.value.message
    assert "bad_schema" not in {listed.name for listed in client.list_evaluators()}
    response = client.evaluate("calc", b"1 + 1")
    assert (outcome(response), response.value) == ("ok", "2")


def test_the_booking_policy_registers_lists_its_schemas_and_answers(daemon: Daemon) -> None:
    """The example tenant policy, as the adapter's tests use it: registered on a real daemon,
    listed with the schemas of its manifest.json, and evaluated."""
    source = json.loads((EXAMPLES_DIR / "booking_policy" / "manifest.json").read_text())
    client = daemon.client("beta")
    client.register(example_path("booking_policy").read_bytes(), replace=True)
    info = {listed.name: listed for listed in client.list_evaluators()}["booking_policy"]
    spec = EvaluatorSpec.from_info(info)
    assert (spec.input_schema, spec.result_schema) == (
        source["input_schema"],
        source["result_schema"],
    )
    response = client.evaluate("booking_policy", b'{"age":34,"components":[6500,1200]}')
    assert (outcome(response), json.loads(response.value)) == (
        "ok",
        {"total": 7700, "action": "book_appointment", "reason": "eligible"},
    )
