"""The client side of an evaluated request, for any server engine: one builder, engine wrappers.

A request that asks a server's adapter to evaluate its spans carries two things, whatever the
engine: a **lowered** structural tag (plain XGrammar formats, which every engine's validation
accepts; ``evaluated_tag`` elements lowered here, with the tenant's evaluators) and the
request options (:mod:`engine_adapter.serving._request_options`: the tenant's token, evald's
address, the tags renamed from their evaluators). :func:`span_request` builds both from one
``ListEvaluators`` call; the engines' request helpers (``engine_adapter.sglang.request``,
``engine_adapter.vllm.request``) only put them where their engine reads them
(``custom_params`` for SGLang, ``extra_args`` for vLLM).

Needs only the evald client (no engine, no torch): it runs on the clients of a server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapter.evaluation import list_evaluators
from engine_adapter.serving._request_options import (
    EXTRA_ARG_EVALUATORS,
    EXTRA_ARG_OPERANDS,
    EXTRA_ARG_TARGET,
    EXTRA_ARG_TOKEN,
)
from engine_adapter.spans import (
    DEFAULT_SPECIAL_EXCLUDES,
    EvaluatorSpec,
    OperandNarrowing,
    build_structural_tag,
    choose_evaluators,
    contains_evaluated_tag,
    lower_evaluated_tags,
    render_instructions,
)
from evald.contract import env_target, env_token

__all__ = [
    "SpanRequest",
    "chosen_evaluators",
    "lowered_tag",
    "request_option_values",
    "span_request",
]


@dataclass(frozen=True)
class SpanRequest:
    """What a request needs to have its spans evaluated, before an engine places it."""

    structural_tag: dict[str, Any]
    """The lowered tag: ``{"type": "structural_tag", "format": …}``."""
    options: dict[str, str]
    """The request options (``evald_token``, ``evald_target``, ``evald_evaluators``)."""
    chosen: list[EvaluatorSpec]
    """The evaluators the model may call, in order (those the instructions describe)."""
    operands: OperandNarrowing | None
    """What ``operands_from`` narrowed, or why nothing; ``None`` when not asked for."""

    def instructions(self, answer_prefix: str = "") -> str:
        """Model-facing instructions for :attr:`chosen` (a system message's text)."""
        return render_instructions(self.chosen, style="system", answer_prefix=answer_prefix)


def span_request(
    target: str | None = None,
    token: str | None = None,
    evaluators: Sequence[str] | None = None,
    *,
    tag: Mapping[str, Any] | str | None = None,
    prefix: str | None = None,
    at_least_one: bool = False,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_EXCLUDES,
    send_target: bool = False,
    operands_from: str | None = None,
    timeout_s: float = 10.0,
) -> SpanRequest:
    """The lowered tag and request options of a request whose spans the server evaluates.

    Parameters are those of ``engine_adapter.vllm.evaluated_request`` (which documents each);
    ``evaluators`` is ignored for the tag when ``tag`` is given (the instructions still use it).

    Raises:
        evald.CallError: evald refused or could not be reached.
        ValueError: an unknown evaluator (the message lists the tenant's).
        engine_adapter.EvaluatedTagError: a bad ``evaluated_tag`` field (names it).
    """
    specs = list_evaluators(target, token, timeout_s=timeout_s)
    if tag is None or evaluators is not None:
        chosen = choose_evaluators(specs, evaluators)
    else:
        chosen = list(specs)
    if tag is not None:
        lowered, operands = _lowered(tag, specs, special_tokens, operands_from)
    else:
        grammar = build_structural_tag(
            chosen,
            "grammar-eval",
            prefix=prefix,
            special_tokens=special_tokens,
            at_least_one=at_least_one,
            operands_from=operands_from,
        )
        assert grammar.structural_tag is not None
        lowered, operands = grammar.structural_tag, grammar.operands
    sent_target = (target or env_target() or "") if send_target else None
    options = request_option_values(token, sent_target, specs)
    return SpanRequest(lowered, options, chosen, operands)


def chosen_evaluators(
    target: str | None = None,
    token: str | None = None,
    evaluators: Sequence[str] | None = None,
    *,
    timeout_s: float = 10.0,
) -> list[EvaluatorSpec]:
    """The tenant's evaluators named by ``evaluators`` (default all), from one
    ``ListEvaluators`` call: what a request's instructions describe."""
    return choose_evaluators(list_evaluators(target, token, timeout_s=timeout_s), evaluators)


def request_option_values(
    token: str | None = None,
    target: str | None = None,
    evaluators: Sequence[EvaluatorSpec] = (),
    *,
    operands_from: str | None = None,
) -> dict[str, str]:
    """The request options that name a request's tenant and its renamed evaluators.

    ``token`` defaults to ``$EVALD_TOKEN`` (and is left out when there is none); ``target`` is
    sent when not ``None``; each evaluator whose tag differs from its name is named
    (``TAG=NAME``), so its spans reach it; ``operands_from`` is the text a JSON schema's
    ``extracted`` properties are narrowed to on the server (``evald_operands_from``).
    """
    options: dict[str, str] = {}
    token = token if token is not None else env_token()
    if token:
        options[EXTRA_ARG_TOKEN] = token
    if target is not None:
        options[EXTRA_ARG_TARGET] = target
    renamed = [f"{spec.tag}={spec.name}" for spec in evaluators if spec.tag != spec.name]
    if renamed:
        options[EXTRA_ARG_EVALUATORS] = ",".join(renamed)
    if operands_from is not None:
        options[EXTRA_ARG_OPERANDS] = operands_from
    return options


def lowered_tag(
    tag: Mapping[str, Any] | str,
    specs: Sequence[EvaluatorSpec],
    *,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_EXCLUDES,
) -> dict[str, Any]:
    """``tag`` with its ``evaluated_tag`` elements lowered (unchanged if it has none)."""
    return _lowered(tag, specs, special_tokens, None)[0]


def _lowered(
    tag: Mapping[str, Any] | str,
    specs: Sequence[EvaluatorSpec],
    special_tokens: Sequence[str],
    operands_from: str | None,
) -> tuple[dict[str, Any], OperandNarrowing | None]:
    parsed = json.loads(tag) if isinstance(tag, str) else dict(tag)
    if not contains_evaluated_tag(parsed):
        return dict(parsed), None
    grammar = lower_evaluated_tags(
        parsed, specs, special_tokens=special_tokens, operands_from=operands_from
    )
    assert grammar.structural_tag is not None
    return dict(grammar.structural_tag), grammar.operands
