"""A computed JSON schema on vLLM without the server: what the API server's validation wrapper
writes into the request, and how the scheduler's tracker rebuilds the plan from it.

The evaluator specs are the real standard evaluators' manifests; the real-server behaviour
(HTTP 400, values forced) is in ``test_vllm_computed.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter import standard_evaluators
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.spans import EvaluatorsUnavailable
from engine_adapter.testing import ESSAY_SCHEMA, extraction_schema, unknown_evaluator_schema
from engine_adapter.vllm._computed_json import (
    COMPUTED_ARG,
    ComputedSchemaRefused,
    computed_plan,
    lower_for_request,
)

CONFIG = AdapterConfig(target="unix:/run/evald/evald.sock", token="server-token")


def params(schema: Any, **extra: Any) -> SimpleNamespace:
    structured = SimpleNamespace(json=schema, grammar=None)
    return SimpleNamespace(structured_outputs=structured, extra_args=extra or None)


def listed(asked: list[tuple[str | None, bool]]) -> Any:
    def evaluators(tenant: AdapterConfig, refresh: bool) -> Any:
        asked.append((tenant.token, refresh))
        return standard_evaluators()

    return evaluators


def test_the_schema_becomes_the_lowered_grammar_and_the_plan_travels() -> None:
    asked: list[tuple[str | None, bool]] = []
    request = params(ESSAY_SCHEMA, evald_token="tenant-token-0123456789")
    lower_for_request(request, CONFIG, listed(asked))
    assert asked == [("tenant-token-0123456789", False)]  # the request's tenant
    assert request.structured_outputs.json is None
    assert request.structured_outputs.grammar.startswith("basic_escape ::=")
    carried = request.extra_args[COMPUTED_ARG]
    assert [m["name"] for m in carried["evaluators"]] == ["calc"]
    json.dumps(request.extra_args)  # what vLLM sends to its engine core
    plan = computed_plan(request)
    assert plan is not None and [f.pointer for f in plan.fields] == ["/answer"]
    assert plan.ebnf == request.structured_outputs.grammar


def test_other_requests_are_left_alone() -> None:
    plain = params({"type": "object", "properties": {"a": {"type": "string"}}})
    lower_for_request(plain, CONFIG, listed([]))
    assert plain.structured_outputs.grammar is None and plain.extra_args is None
    assert computed_plan(plain) is None
    none = SimpleNamespace(structured_outputs=None, extra_args=None)
    lower_for_request(none, CONFIG, listed([]))


def test_a_refused_schema_names_the_field() -> None:
    asked: list[tuple[str | None, bool]] = []
    with pytest.raises(ComputedSchemaRefused) as refused:
        lower_for_request(params(json.dumps(unknown_evaluator_schema())), CONFIG, listed(asked))
    assert str(refused.value).startswith("/properties/answer/computed/by: unknown evaluator")
    assert asked == [("server-token", False), ("server-token", True)]  # asked again, fresh
    assert isinstance(refused.value, ValueError)  # vLLM answers HTTP 400


def test_unlisted_evaluators_and_a_refused_tenant_are_refused_at_the_root() -> None:
    def down(tenant: AdapterConfig, refresh: bool) -> Any:
        raise EvaluatorsUnavailable("ListEvaluators at unix:/x failed: connection refused")

    with pytest.raises(ComputedSchemaRefused, match=r"^/: cannot list .* connection refused"):
        lower_for_request(params(ESSAY_SCHEMA), CONFIG, down)
    foreign = params(ESSAY_SCHEMA, evald_target="10.9.9.9:1")
    with pytest.raises(ComputedSchemaRefused, match="permission_denied"):
        lower_for_request(foreign, CONFIG, listed([]))


def test_the_operands_text_narrows_in_both_processes() -> None:
    request = params(extraction_schema(), evald_operands_from="codes 8675309 and 4242")
    lower_for_request(request, CONFIG, listed([]))
    grammar = request.structured_outputs.grammar
    assert "8675309" in grammar and "4242" in grammar
    plan = computed_plan(request)
    assert plan is not None and plan.ebnf == grammar


def test_a_plan_that_does_not_lower_to_the_grammar_is_not_followed() -> None:
    request = params(ESSAY_SCHEMA)
    lower_for_request(request, CONFIG, listed([]))
    request.extra_args[COMPUTED_ARG]["schema"] = json.dumps(extraction_schema())
    with pytest.raises(ValueError, match="does not lower to the request's grammar"):
        computed_plan(request)
    request.extra_args[COMPUTED_ARG] = "junk"
    with pytest.raises(ValueError, match="is not what the API server writes"):
        computed_plan(request)


def test_the_request_helper_sends_the_schema_as_written() -> None:
    from engine_adapter.vllm import computed_json_body

    body = computed_json_body(ESSAY_SCHEMA, "t", operands_from="I am 46")
    assert body == {
        "structured_outputs": {"json": ESSAY_SCHEMA},
        "vllm_xargs": {"evald_token": "t", "evald_operands_from": "I am 46"},
    }
