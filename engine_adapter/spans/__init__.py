"""The span and grammar language: what a span is, how a request's grammar is written, no I/O.

A span kind (:class:`SpanBinding`) and what evaluates it (:class:`SpanEvaluator`,
:class:`EvalResult`); evaluator manifests turned into an XGrammar structural tag
(:func:`build_structural_tag`); the ``evaluated_tag`` request format and its lowering
(:func:`lower_evaluated_tags`, :func:`plan_spans`); operands from the context
(:func:`narrow_to_operands`); computed properties of a JSON schema (:func:`lower_computed_schema`,
docs/computed-fields.md); the model-facing instructions (:func:`render_instructions`).

Nothing here opens a socket or reads a model: every function is a pure mapping from manifests
and text to grammars and bindings, so the engines, the request builders and the lab share one
reading of the span protocol. Only ``evald.contract`` lies below.
"""

from engine_adapter.spans._computed_lowering import lower_computed_schema
from engine_adapter.spans._computed_schema import (
    COMPUTED_KEYWORD,
    EXTRACTED_KEYWORD,
    ComputedField,
    ComputedPlan,
    ComputedSchemaError,
    contains_computed,
)
from engine_adapter.spans._computed_values import (
    ERROR_KEY,
    ERROR_SCHEMA,
    SCHEMA_MISMATCH,
    ValueCheck,
    render_error,
)
from engine_adapter.spans._evaluated_tag import (
    EvaluatedTagError,
    contains_evaluated_tag,
    lower_evaluated_tags,
)
from engine_adapter.spans._grammar import (
    DEFAULT_SPECIAL_EXCLUDES,
    ERROR_CODE_REGEX,
    EvaluatorExample,
    EvaluatorSpec,
    Mode,
    SpanGrammar,
    build_structural_tag,
    check_bindings,
    choose_evaluators,
    common_prefix,
    narrow_to_operands,
    span_format,
    special_token_texts,
    standard_evaluators,
)
from engine_adapter.spans._instructions import (
    BASE_PROMPT_FORMAT,
    INSTRUCTION_STYLES,
    base_prompt,
    render_instructions,
)
from engine_adapter.spans._lowered_spans import (
    EvaluatorsUnavailable,
    SpanPlan,
    find_lowered_spans,
    plan_spans,
)
from engine_adapter.spans._operands import EvaluatorOperands, OperandNarrowing, literals_in_text
from engine_adapter.spans._types import EvalResult, SpanBinding, SpanEvaluator

__all__ = [
    "BASE_PROMPT_FORMAT",
    "COMPUTED_KEYWORD",
    "DEFAULT_SPECIAL_EXCLUDES",
    "ERROR_CODE_REGEX",
    "ERROR_KEY",
    "ERROR_SCHEMA",
    "EXTRACTED_KEYWORD",
    "INSTRUCTION_STYLES",
    "SCHEMA_MISMATCH",
    "ComputedField",
    "ComputedPlan",
    "ComputedSchemaError",
    "EvalResult",
    "EvaluatedTagError",
    "EvaluatorExample",
    "EvaluatorOperands",
    "EvaluatorSpec",
    "EvaluatorsUnavailable",
    "Mode",
    "OperandNarrowing",
    "SpanBinding",
    "SpanEvaluator",
    "SpanGrammar",
    "SpanPlan",
    "ValueCheck",
    "base_prompt",
    "build_structural_tag",
    "check_bindings",
    "choose_evaluators",
    "common_prefix",
    "contains_computed",
    "contains_evaluated_tag",
    "find_lowered_spans",
    "literals_in_text",
    "lower_computed_schema",
    "lower_evaluated_tags",
    "narrow_to_operands",
    "plan_spans",
    "render_error",
    "render_instructions",
    "span_format",
    "special_token_texts",
    "standard_evaluators",
]
