"""Client side: the structural tag that asks an SGLang server with the adapter to evaluate spans.

Needs only the evald client (no SGLang, no torch)::

    from engine_adapter.sglang.request import structural_tag_for
    tag = structural_tag_for("unix:/run/evald/evald.sock", token, ["calc"])
    # OpenAI-compatible API
    client.chat.completions.create(model=..., messages=..., response_format=tag)
    # native /generate, or sglang.Engine.generate
    {"text": ..., "sampling_params": {"structural_tag": json.dumps(tag)}}

    # opt-in: tell the model how to write spans (a system message rendered from the manifests)
    messages = [*instruction_messages("unix:/run/evald/evald.sock", token, ["calc"]), *messages]

    # the request's tenant (a server may serve many): its token travels in custom_params
    client.chat.completions.create(..., extra_body={"custom_params": tenant_params(token)})

    # operands from the context: the span's numbers (and strop's words) must be the question's
    tag = structural_tag_for(target, token, ["calc"], operands_from=question)

The tag is in the lowered form (plain XGrammar formats, see
``engine_adapter.spans._lowered_spans``), so it passes the OpenAI layer's schema validation; the
server recognises its evaluated spans.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from engine_adapter.serving import chosen_evaluators, request_option_values, span_request
from engine_adapter.spans import DEFAULT_SPECIAL_EXCLUDES, EvaluatorSpec, render_instructions

__all__ = [
    "OperandsOff",
    "generate_sampling_params",
    "instruction_messages",
    "structural_tag_for",
    "tenant_params",
]


class OperandsOff(UserWarning):
    """The operands option narrowed nothing for this request (the text holds no literal any
    evaluator accepts); the grammar is the usual one. The message says why per evaluator."""


def structural_tag_for(
    target: str | None = None,
    token: str | None = None,
    evaluators: Sequence[str] | None = None,
    *,
    prefix: str | None = None,
    at_least_one: bool = False,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_EXCLUDES,
    operands_from: str | None = None,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """The structural tag for a request whose spans the server's adapter evaluates.

    Parameters:
        target: evald's address (``unix:PATH`` or ``HOST:PORT``); default ``$EVALD_TARGET``.
            It must be the evald the server uses (or one with the same evaluators), since the
            span grammars come from its ``ListEvaluators``.
        token: the tenant's token; default ``$EVALD_TOKEN``.
        evaluators: names (or tags) of the evaluators the model may call, in this order;
            default every evaluator the tenant may call.
        prefix: text the answer must begin with; ending it with a span opener
            (``"The expression is <calc>"``) makes the model write a span at once.
        at_least_one: require at least one span.
        special_tokens: texts free text must not contain (the model's chat markers).
        operands_from: operands from the context, typically the user's message: every literal
            rule the evaluators' manifests declare (numbers, strings) allows only the literals
            of this text (:func:`engine_adapter.narrow_to_operands`). The grammar is then this
            request's own (compiled for it, never a cache hit).
        timeout_s: for the ``ListEvaluators`` call.

    Returns:
        ``{"type": "structural_tag", "format": …}``: pass it as the OpenAI ``response_format``,
        or as ``json.dumps(tag)`` in ``sampling_params["structural_tag"]``.

    Raises:
        evald.CallError: evald refused or could not be reached.
        ValueError: an evaluator that the tenant cannot call (the message lists those it can).

    Warns:
        OperandsOff: ``operands_from`` narrowed nothing; the tag is the usual one.
    """
    request = span_request(
        target,
        token,
        evaluators,
        prefix=prefix,
        at_least_one=at_least_one,
        special_tokens=special_tokens,
        operands_from=operands_from,
        timeout_s=timeout_s,
    )
    if request.operands is not None and not request.operands.applied:
        warnings.warn(
            f"the operands option is off: {request.operands.reason}", OperandsOff, stacklevel=2
        )
    return request.structural_tag


def instruction_messages(
    target: str | None = None,
    token: str | None = None,
    evaluators: Sequence[str] | None = None,
    *,
    answer_prefix: str = "",
    timeout_s: float = 10.0,
) -> list[dict[str, str]]:
    """A system message that tells a chat model how to write the evaluators' spans, rendered
    from their manifests (:func:`engine_adapter.render_instructions`, ``system`` style): prepend
    it to the request's ``messages``. Opt-in; the text is what the caller sends, nothing is
    added on the server.

    Parameters are those of :func:`structural_tag_for`; ``answer_prefix`` is the text before
    the span in each example (use the request's forced prefix, if any, without its opener).

    Raises:
        evald.CallError: evald refused or could not be reached.
        ValueError: an evaluator that the tenant cannot call.
    """
    specs = chosen_evaluators(target, token, evaluators, timeout_s=timeout_s)
    text = render_instructions(specs, style="system", answer_prefix=answer_prefix)
    return [{"role": "system", "content": text}]


def tenant_params(
    token: str | None = None,
    target: str | None = None,
    *,
    evaluators: Sequence[EvaluatorSpec] = (),
    operands_from: str | None = None,
) -> dict[str, str]:
    """``custom_params`` that name a request's tenant, so the server's adapter evaluates its spans
    under that tenant's token (and lowers its ``evaluated_tag`` elements with that tenant's
    evaluators) instead of the server's ``EVALD_TOKEN``.

    Parameters:
        token: the tenant's token; default ``$EVALD_TOKEN``.
        target: evald's address, only if the server should use another evald than its own
            (it must be one of the server's ``EVALD_ALLOWED_TARGETS``).
        evaluators: the tenant's evaluators; those whose tag differs from their name are
            named (``evald_evaluators``), so their spans reach them.
        operands_from: for a ``json_schema`` with ``"extracted": true`` properties, the text
            they are narrowed to (``evald_operands_from``; typically the user's message).

    Returns:
        For ``sampling_params["custom_params"]`` (``/generate``) or the OpenAI API's
        ``custom_params`` (``extra_body``). A bad token or address is answered in band,
        ``<result_error>permission_denied</result_error>``.
    """
    return request_option_values(token, target or None, evaluators, operands_from=operands_from)


def generate_sampling_params(
    tag: dict[str, Any] | None = None,
    *,
    json_schema: Mapping[str, Any] | None = None,
    custom_params: dict[str, Any] | None = None,
    **sampling: Any,
) -> dict[str, Any]:
    """``sampling_params`` for ``/generate`` or ``sglang.Engine.generate`` with ``tag``, or with
    ``json_schema`` (a schema whose ``computed`` properties the server computes,
    docs/computed-fields.md), and the request's tenant (:func:`tenant_params`).

    Raises:
        ValueError: both or neither of ``tag`` and ``json_schema``.
    """
    if (tag is None) == (json_schema is None):
        raise ValueError("give a structural tag or a json_schema (one of them)")
    key, value = ("structural_tag", tag) if tag is not None else ("json_schema", json_schema)
    params = {**sampling, key: json.dumps(value, ensure_ascii=False)}
    if custom_params:
        params["custom_params"] = dict(custom_params)
    return params
