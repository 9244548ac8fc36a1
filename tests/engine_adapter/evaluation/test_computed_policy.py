"""A tenant's policy decides a computed property, end to end with real parts: the booking policy
built with the SDK (Zig, its JSON library), registered on a real daemon by its tenant, listed
with its manifest's schemas, and called over the evald stream from the document state that SmolLM2's
real tokenizer and XGrammar's real matcher drive."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest

xgr = pytest.importorskip("xgrammar")

from engine_adapter import (  # noqa: E402
    ComputedFieldsState,
    ComputedSchemaError,
    EvaluatorClient,
    TokenCodec,
    list_evaluators,
    lower_computed_schema,
)
from engine_adapter.local import load_tokenizer  # noqa: E402
from evald.client import Client  # noqa: E402
from evald.testing import tenant_table  # noqa: E402
from evaluators_wasm import example_path  # noqa: E402
from evaluators_wasm.reference import reference  # noqa: E402

TOKEN = "policy-tenant-token-0123456789"
CONFIG = f"""
[server]
threads = 2
shutdown_grace_s = 1

{tenant_table("clinic", token=TOKEN, evaluators=["*"], allow_register=True, max_modules=8)}
"""
DECISION = {
    "type": "object",
    "properties": {
        "total": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "action": {"enum": ["book_appointment", "offer_alternative", "decline", "escalate_human"]},
        "reason": {"type": "string"},
    },
    "required": ["total", "action", "reason"],
}
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_age": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "price_components": {"type": "array", "items": {"type": "number"}, "maxItems": 10},
        "decision": {
            **DECISION,
            "computed": {
                "by": "booking_policy",
                "from": {"age": "/customer_age", "components": "/price_components"},
            },
        },
        "reply": {"type": "string"},
    },
    "required": ["customer_age", "price_components", "decision", "reply"],
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from daemon_harness import start_daemon

    handle = start_daemon(tmp_path_factory.mktemp("evald"), CONFIG)
    try:
        with Client(handle.target, TOKEN) as client:
            client.register(example_path("booking_policy").read_bytes(), replace=True)
        yield handle
    finally:
        handle.stop()


@functools.cache
def tokenizer_info() -> Any:
    return xgr.TokenizerInfo.from_huggingface(load_tokenizer(), vocab_size=len(load_tokenizer()))


def run(daemon: Any, facts: str) -> tuple[dict[str, Any], ComputedFieldsState]:
    grammar = lower_computed_schema(SCHEMA, list_evaluators(daemon.target, TOKEN))
    assert grammar.computed is not None
    compiler = xgr.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False)
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(grammar.json()))
    codec = TokenCodec.from_tokenizer(load_tokenizer(), tokenizer_info=tokenizer_info())
    with EvaluatorClient(daemon.target, TOKEN) as client:
        assert client.wait_connected(30.0)
        state = ComputedFieldsState(codec, grammar.computed, client, deadline_ms=10_000)

        def feed(tokens: list[int]) -> None:
            for token in tokens:
                assert matcher.accept_token(token), state.text
                state.accept_token(token)

        feed(load_tokenizer().encode(facts, add_special_tokens=False))
        while state.pending:
            forced = state.forced_tokens()
            if forced:
                feed(forced)
            else:
                state.wait(timeout_s=10.0)
        feed(load_tokenizer().encode(', "reply": "Thanks."}', add_special_tokens=False))
    return json.loads(state.text), state


@pytest.mark.parametrize(
    ("age", "components"),
    [(34, [6500, 1200]), (46, [6500, 4250]), (17, [300]), (71, [100, 200]), (None, [5000]),
     (40, []), (30, [10000]), (30, [12000, 0.5])],
)  # fmt: skip
def test_the_decision_is_the_policy_of_the_facts_written(
    daemon: Any, age: int | None, components: list[float]
) -> None:
    facts = json.dumps({"customer_age": age, "price_components": components})[:-1]
    document, state = run(daemon, facts)
    policy_input = json.dumps({"age": age, "components": components}, separators=(",", ":"))
    expected = json.loads(reference("booking_policy")(policy_input.encode()))
    assert document["decision"] == expected
    (record,) = state.spans
    assert (record.field, record.content) == ("/decision", policy_input)


def test_the_policys_manifest_checks_the_request(daemon: Any) -> None:
    specs = list_evaluators(daemon.target, TOKEN)
    narrow = json.loads(json.dumps(SCHEMA))
    narrow["properties"]["decision"]["properties"]["action"]["enum"] = ["book_appointment"]
    with pytest.raises(ComputedSchemaError) as caught:
        lower_computed_schema(narrow, specs)
    assert caught.value.path == "/properties/decision/computed/by"
    assert "'offer_alternative'" in caught.value.message
    unbounded = json.loads(json.dumps(SCHEMA))
    unbounded["properties"]["decision"]["computed"]["from"] = {"age": "/customer_age"}
    with pytest.raises(ComputedSchemaError, match="needs the input 'components'"):
        lower_computed_schema(unbounded, specs)

