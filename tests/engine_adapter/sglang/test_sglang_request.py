"""The client-side helper: the structural tag built from the daemon's ``ListEvaluators``."""

from __future__ import annotations

import json

import pytest
from daemon_harness import Daemon
from sglang_harness import CALC_ONLY_TOKEN, TOKEN

from engine_adapter import build_structural_tag, list_evaluators, render_instructions
from engine_adapter.sglang import (
    OperandsOff,
    generate_sampling_params,
    instruction_messages,
    structural_tag_for,
)
from engine_adapter.spans._lowered_spans import plan_spans


def test_tag_is_the_span_grammar_of_the_tenants_evaluators(daemon: Daemon) -> None:
    specs = list_evaluators(daemon.target, TOKEN)
    tag = structural_tag_for(daemon.target, TOKEN, ["strop", "calc"], prefix="So <calc>")
    chosen = [next(s for s in specs if s.name == n) for n in ("strop", "calc")]
    grammar = build_structural_tag(chosen, "grammar-eval", prefix="So <calc>")
    assert tag == grammar.structural_tag
    plan = plan_spans(json.dumps(tag), lambda refresh: specs)
    assert plan is not None and set(plan.bindings) == set(grammar.bindings)
    assert [b.evaluator for b in plan.bindings] == ["calc", "strop"], "document order"


def test_operands_from_narrows_the_tag_and_warns_when_it_cannot(daemon: Daemon) -> None:
    pytest.importorskip("xgrammar")
    question = "A hall has 38 rows of 27 chairs and 61 more. How many chairs?"
    specs = [s for s in list_evaluators(daemon.target, TOKEN) if s.name == "calc"]
    tag = structural_tag_for(
        daemon.target, TOKEN, ["calc"], prefix="So <calc>", operands_from=question
    )
    narrowed = build_structural_tag(specs, prefix="So <calc>", operands_from=question)
    assert tag == narrowed.structural_tag
    assert tag != structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="So <calc>")
    # the server still recognises the span by its opener
    plan = plan_spans(json.dumps(tag), lambda refresh: specs)
    assert plan is not None and [b.evaluator for b in plan.bindings] == ["calc"]
    with pytest.warns(OperandsOff, match="calc: the text holds no literal its grammar accepts"):
        plain = structural_tag_for(
            daemon.target, TOKEN, ["calc"], operands_from="How many r's in strawberry?"
        )
    assert plain == structural_tag_for(daemon.target, TOKEN, ["calc"])


def test_default_is_every_evaluator_the_tenant_may_call(daemon: Daemon) -> None:
    tag = structural_tag_for(daemon.target, CALC_ONLY_TOKEN)
    assert tag["format"]["triggers"] == ["<calc>"]


def test_an_evaluator_the_tenant_cannot_call_is_refused_with_the_list(daemon: Daemon) -> None:
    with pytest.raises(ValueError, match=r"'strop' not available.*available: calc"):
        structural_tag_for(daemon.target, CALC_ONLY_TOKEN, ["strop"])


def test_generate_sampling_params_carry_the_tag_as_json() -> None:
    params = generate_sampling_params({"type": "structural_tag"}, max_new_tokens=8)
    assert params == {"max_new_tokens": 8, "structural_tag": '{"type": "structural_tag"}'}


def test_instruction_messages_render_the_tenants_manifests_from_list_evaluators(
    daemon: Daemon,
) -> None:
    (message,) = instruction_messages(daemon.target, TOKEN, ["calc"], answer_prefix="So ")
    assert message["role"] == "system"
    (calc,) = [s for s in list_evaluators(daemon.target, TOKEN) if s.name == "calc"]
    assert message["content"] == render_instructions([calc], answer_prefix="So ")
    assert "So <calc>17 * 23 + 91</calc><result>482</result>" in message["content"]
    with pytest.raises(ValueError, match="not available"):
        instruction_messages(daemon.target, CALC_ONLY_TOKEN, ["strop"])


def test_tenant_params_name_the_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import dataclass

    from engine_adapter.sglang import tenant_params

    @dataclass
    class Spec:
        name: str
        tag: str

    monkeypatch.setenv("EVALD_TOKEN", "from-env")
    assert tenant_params() == {"evald_token": "from-env"}
    specs = [Spec("calc", "calc"), Spec("u2", "units")]
    assert tenant_params("t", "unix:/x", evaluators=specs) == {
        "evald_token": "t", "evald_target": "unix:/x", "evald_evaluators": "units=u2",
    }  # fmt: skip
    monkeypatch.delenv("EVALD_TOKEN")
    assert tenant_params() == {}
    params = generate_sampling_params({"type": "structural_tag"}, custom_params={"x": "t"})
    assert params["custom_params"] == {"x": "t"}
    assert json.loads(params["structural_tag"]) == {"type": "structural_tag"}


def test_a_computed_json_schema_request() -> None:
    """``json_schema=`` in place of a tag, the operands text among the tenant's params."""
    from engine_adapter.sglang import tenant_params
    from engine_adapter.testing import ESSAY_SCHEMA

    custom = tenant_params("t", operands_from="I am 46")
    assert custom == {"evald_token": "t", "evald_operands_from": "I am 46"}
    params = generate_sampling_params(json_schema=ESSAY_SCHEMA, custom_params=custom)
    assert json.loads(params["json_schema"]) == ESSAY_SCHEMA and "structural_tag" not in params
    with pytest.raises(ValueError, match="one of them"):
        generate_sampling_params({"type": "structural_tag"}, json_schema=ESSAY_SCHEMA)
