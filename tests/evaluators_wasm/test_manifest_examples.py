"""The manifests' examples, which request helpers render into model-facing instructions, are
true and writable: each input is in the model grammar (a model can copy its form), the module and
the reference give it the example's value, the value matches the result regex, and the module
carries the examples in its embedded manifest (so ``ListEvaluators`` can send them)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from evald.contract import MAX_EXAMPLES, STANDARD_EVALUATORS
from evald.host import inspect_module
from evaluators_wasm import SOURCE_DIR, wasm_path
from evaluators_wasm.reference import reference
from tests.evaluators_wasm.support import Evaluator, Guest


def _manifest(name: str) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((SOURCE_DIR / name / "manifest.json").read_text("utf-8"))
    return manifest


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_examples_are_true_and_in_the_model_grammar(guest: Guest, name: str) -> None:
    examples = _manifest(name)["examples"]
    assert 2 <= len(examples) <= MAX_EXAMPLES
    evaluator = Evaluator(name, ())
    for example in examples:
        assert example["question"].strip(), "every standard example says what it answers"
        text = example["input"]
        assert evaluator.grammar_accepts(text), f"{name}: the model grammar refuses {text!r}"
        assert reference(name)(text.encode()) == example["value"]
        value, code, _ = guest(name, text.encode())
        assert (value, code) == (example["value"], None)
        assert re.fullmatch(evaluator.manifest["result_regex"], example["value"])


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_the_module_embeds_the_examples(name: str) -> None:
    manifest, _ = inspect_module(wasm_path(name).read_bytes())
    assert [dict(e) for e in manifest.examples] == _manifest(name)["examples"]
