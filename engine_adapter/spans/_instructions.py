"""Model-facing instructions rendered from the evaluators' manifests, the way tool calling ships
tool descriptions.

A grammar can make a model write a span, but only the model can set the problem up inside it; a
135M-270M model does that far more often when it has seen a few solved requests. Each manifest
carries a one-line ``description`` and a few ``examples`` (``question`` → span ``input`` →
``value``); :func:`render_instructions` turns them into plain text:

- ``system``: a short system message for a chat model (``LocalEngine(system_prompt=...)``,
  ``engine-adapter generate --instructions``,
  :func:`engine_adapter.sglang.request.instruction_messages`).
- ``few-shot``: solved examples only, in the ``Question:``/``Answer:`` form of
  :data:`BASE_PROMPT_FORMAT` that :class:`~engine_adapter.LocalEngine` uses for a base model
  (one without a chat template), so that the question continues the pattern.

Opt-in everywhere (nothing adds them behind the caller's back), and the text is returned as is so
that a user can read exactly what the model was told. Solved examples in the answer's own form are
what small models follow best; prose about syntax helps them little.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_adapter.spans._grammar import EvaluatorExample, EvaluatorSpec

__all__ = [
    "BASE_PROMPT_FORMAT",
    "INSTRUCTION_STYLES",
    "base_prompt",
    "render_example",
    "render_instructions",
]

#: The styles :func:`render_instructions` knows.
INSTRUCTION_STYLES = ("system", "few-shot")

#: How a base model (no chat template) is asked a question; the answer starts on the next line.
BASE_PROMPT_FORMAT = "Question: {question}\nAnswer:\n"

_SYSTEM_HEADER = (
    "Answer with a tool. Write the tool's tag with the input inside, for example "
    "{example}; the tool then writes the value in {result_begin}...{result_end}."
)


def base_prompt(question: str, preamble: str = "") -> str:
    """The text a base model continues: ``preamble`` (e.g. a few-shot block), then the question
    in :data:`BASE_PROMPT_FORMAT`."""
    return preamble + BASE_PROMPT_FORMAT.format(question=question)


def render_example(spec: EvaluatorSpec, example: EvaluatorExample, answer_prefix: str = "") -> str:
    """One solved example's answer: ``answer_prefix<tag>input</tag><result>value</result>``."""
    binding = spec.binding()
    return (
        f"{answer_prefix}{binding.begin}{example.input}{binding.end}"
        f"{binding.result_begin}{example.value}{binding.result_end}"
    )


def render_instructions(
    evaluators: Sequence[EvaluatorSpec],
    *,
    style: str = "system",
    answer_prefix: str = "",
    max_examples: int | None = None,
) -> str:
    """Instructions for a model that may write spans of these evaluators.

    Parameters:
        evaluators: the grammar's evaluators (``LocalEngine.evaluators``, ``ListEvaluators``
            or :func:`engine_adapter.standard_evaluators`), in the order to present them.
        style: ``system`` (a system message for a chat model) or ``few-shot`` (solved examples
            in the :data:`BASE_PROMPT_FORMAT` form, for a base model).
        answer_prefix: text each example answer starts with before the span; use the same
            text as a forced ``prefix`` so that the examples show the answer the model writes.
        max_examples: at most this many examples per evaluator (default: all).

    Returns:
        The text, ending with a blank line in the ``few-shot`` style (the question follows).

    Raises:
        ValueError: an unknown style, no evaluators, or a question-less example in the
            ``few-shot`` style (a base model needs the question to follow the pattern).
    """
    if style not in INSTRUCTION_STYLES:
        raise ValueError(f"unknown style {style!r}; choose from {', '.join(INSTRUCTION_STYLES)}")
    if not evaluators:
        raise ValueError("no evaluators to describe")
    chosen = [
        (spec, spec.examples[:max_examples] if max_examples is not None else spec.examples)
        for spec in evaluators
    ]
    if style == "few-shot":
        blocks = []
        for spec, examples in chosen:
            for example in examples:
                if not example.question:
                    raise ValueError(
                        f"a {spec.name} example has no question; the few-shot style needs one"
                    )
                blocks.append(
                    base_prompt(example.question) + render_example(spec, example, answer_prefix)
                )
        return "\n\n".join(blocks) + "\n\n"
    first = next((spec for spec, examples in chosen if examples), evaluators[0])
    sample = (
        render_example(first, first.examples[0])
        if first.examples
        else f"{first.binding().begin}...{first.binding().end}"
    )
    binding = first.binding()
    lines = [
        _SYSTEM_HEADER.format(
            example=sample, result_begin=binding.result_begin, result_end=binding.result_end
        )
    ]
    for spec, examples in chosen:
        lines.append("")
        tag = spec.binding().begin
        lines.append(f"{tag} {spec.description}" if spec.description else tag)
        for example in examples:
            answer = render_example(spec, example, answer_prefix)
            if example.question:
                lines.append(f"Question: {example.question}")
                lines.append(f"Answer: {answer}")
            else:
                lines.append(answer)
    return "\n".join(lines)
