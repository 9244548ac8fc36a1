"""A ``json_schema`` with computed properties inside SGLang's real grammar layer: the
``dispatch_json`` hook, SGLang's grammar cache and reasoning frame, played as SGLang's
scheduler plays them (``sglang_harness``), values from the real daemon.

The real servers (native ``/generate``, the OpenAI API, HTTP 400) are in
``test_sglang_computed.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.constrained.xgrammar_backend",
    reason="SGLang's grammar layer is not installed (pip install --no-deps sglang==0.5.23)",
)

from sglang_harness import MiniScheduler, Row, ScriptedModel

from engine_adapter.sglang import EvaluatorGrammar
from engine_adapter.testing import ESSAY_SCHEMA, unknown_evaluator_schema

pytestmark = pytest.mark.sglang

ESSAY = json.dumps(ESSAY_SCHEMA)


def run_one(backend: Any, tokenizer: Any, grammar: Any, script: str) -> str:
    codec = backend._evald_runtime.codec
    row = Row(grammar, ScriptedModel(codec, tokenizer.eos_token_id, script))
    loop = MiniScheduler(codec, tokenizer.eos_token_id, len(tokenizer), [row])
    loop.run()
    assert row.aborted is None and grammar.is_terminated()
    return loop.text(row).removesuffix(tokenizer.eos_token)


def test_the_computed_value_is_the_daemons(backend: Any, tokenizer: Any) -> None:
    """The model wants to write ``"answer": 1``; the daemon's 144 is forced instead."""
    grammar = backend.dispatch_json(ESSAY)
    assert isinstance(grammar, EvaluatorGrammar) and grammar.computed is not None
    text = run_one(backend, tokenizer, grammar, '{"expression": "12 * 12", "answer": 1}')
    assert json.loads(text) == {"expression": "12 * 12", "answer": 144}, text
    (record,) = grammar.spans
    assert (record.field, record.content, record.value) == ("/answer", "12 * 12", "144")


def test_the_openai_response_format_reaches_the_same_hook(backend: Any) -> None:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "12 * 12?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "essay", "schema": ESSAY_SCHEMA},
        },
    )
    params = request.to_sampling_params(stop=[], model_generation_config={})
    grammar = backend.dispatch_json(params["json_schema"])
    assert isinstance(grammar, EvaluatorGrammar) and grammar.computed is not None


def test_plain_schemas_stay_sglangs_and_bad_ones_name_the_field(backend: Any) -> None:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    plain = backend.dispatch_json(json.dumps({"type": "object", "properties": {}}))
    assert type(plain) is XGrammarGrammar
    bad = backend.dispatch_json(json.dumps(unknown_evaluator_schema()))
    assert isinstance(bad, InvalidGrammarObject)
    assert bad.error_message.startswith(
        "/properties/answer/computed/by: unknown evaluator 'no_such_evaluator'"
    ), bad.error_message


def test_the_plan_survives_sglangs_cache_and_reasoning_frame(backend: Any) -> None:
    grammar = backend.dispatch_json(ESSAY)
    assert isinstance(grammar, EvaluatorGrammar)
    copied = grammar.copy()  # what SGLang's grammar cache hands the next request
    assert isinstance(copied, EvaluatorGrammar) and copied.computed is grammar.computed
    assert copied.injector is not grammar.injector
    framed = backend.compile_framed_grammar(
        grammar,
        lambda content: {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [{"type": "const_string", "value": "<think>ok</think>"}, content],
            },
        },
    )
    assert isinstance(framed, EvaluatorGrammar) and framed.computed is grammar.computed


def test_a_computed_schema_inside_a_structural_tag_is_refused(backend: Any) -> None:
    """What SGLang's chat API sends when a reasoning parser frames a ``json_schema``: refused,
    never compiled with the keyword ignored (the model would write the value itself)."""
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    tag = {
        "type": "structural_tag",
        "format": {"type": "json_schema", "json_schema": ESSAY_SCHEMA},
    }
    refused = backend.dispatch_structural_tag(json.dumps(tag))
    assert isinstance(refused, InvalidGrammarObject)
    assert "not inside a structural tag" in refused.error_message
