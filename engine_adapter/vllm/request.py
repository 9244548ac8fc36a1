"""Client side: what a request sends to a vLLM server with the adapter, so its spans are evaluated.

Needs only the evald client (no vLLM, no torch)::

    from engine_adapter.vllm.request import evaluated_request
    req = evaluated_request("unix:/run/evald/evald.sock", token, ["calc"])
    # OpenAI-compatible API (/v1/completions, /v1/chat/completions)
    client.completions.create(model=..., prompt=..., extra_body=req.extra_body())
    # offline vllm.LLM
    SamplingParams(max_tokens=64, **req.sampling_params_kwargs())

The structural tag is sent **lowered** (plain XGrammar formats, see
``engine_adapter.spans._lowered_spans``): vLLM validates and compiles structural tags with XGrammar
before any plugin sees them, so an ``evaluated_tag`` element is lowered here, on the client,
with the tenant's evaluators. The tenant's token and evald's address travel in
``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.serving import lowered_tag, request_option_values, span_request
from engine_adapter.spans import DEFAULT_SPECIAL_EXCLUDES, EvaluatorSpec, OperandNarrowing

__all__ = ["EvaluatedRequest", "computed_json_body", "evaluated_request", "lower_for_vllm"]


@dataclass(frozen=True)
class EvaluatedRequest:
    """The parts of a request that ask the server's adapter to evaluate spans."""

    structural_tag: dict[str, Any]
    """The lowered tag: ``{"type": "structural_tag", "format": …}``."""
    extra_args: dict[str, str] = field(default_factory=dict)
    """For ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP)."""
    instructions: str = ""
    """Model-facing instructions for the request's evaluators, rendered from their manifests
    (:func:`engine_adapter.render_instructions`). Opt-in: nothing is sent unless the caller
    adds them (:meth:`with_instructions`)."""
    operands: OperandNarrowing | None = None
    """What ``operands_from`` narrowed (``applied``), or why nothing (``reason``); ``None``
    when the request did not ask for it."""

    def with_instructions(self, messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
        """``messages`` for the chat API with the instructions as a leading system message."""
        return [{"role": "system", "content": self.instructions}, *map(dict, messages)]

    def extra_body(self, **more: Any) -> dict[str, Any]:
        """``extra_body`` for the OpenAI client (or fields to merge into a raw JSON body)."""
        body: dict[str, Any] = {
            "structured_outputs": {"structural_tag": json.dumps(self.structural_tag)},
            **more,
        }
        if self.extra_args:
            body["vllm_xargs"] = {**self.extra_args, **more.get("vllm_xargs", {})}
        return body

    def sampling_params_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.SamplingParams`` (offline ``vllm.LLM``)."""
        from vllm.sampling_params import StructuredOutputsParams

        return {
            "structured_outputs": StructuredOutputsParams(
                structural_tag=json.dumps(self.structural_tag)
            ),
            "extra_args": dict(self.extra_args),
        }


def evaluated_request(
    target: str | None = None,
    token: str | None = None,
    evaluators: Sequence[str] | None = None,
    *,
    tag: Mapping[str, Any] | str | None = None,
    prefix: str | None = None,
    at_least_one: bool = False,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_EXCLUDES,
    send_target: bool = False,
    answer_prefix: str = "",
    operands_from: str | None = None,
    timeout_s: float = 10.0,
) -> EvaluatedRequest:
    """The structural tag and extra arguments for a request whose spans the server evaluates.

    Parameters:
        target: evald's address (``unix:PATH`` or ``HOST:PORT``); default ``$EVALD_TARGET``.
            It must be the evald the server uses (or one with the same evaluators).
        token: the tenant's token; default ``$EVALD_TOKEN``. Sent as ``evald_token``.
        evaluators: names (or tags) of the evaluators the model may call; default all the
            tenant may call. Ignored when ``tag`` is given.
        tag: your own structural tag with ``evaluated_tag`` elements (lowered here), instead of
            the standard one.
        prefix, at_least_one, special_tokens: as for
            :func:`engine_adapter.build_structural_tag`.
        send_target: also send ``evald_target`` (the server accepts only its own
            ``EVALD_TARGET`` or one of ``EVALD_ALLOWED_TARGETS``).
        answer_prefix: the text before the span in the instructions' examples (the request's
            forced prefix without its opener, if any).
        operands_from: operands from the context, typically the user's message: every literal
            rule the evaluators' manifests declare (numbers, strings) allows only the literals
            of this text (:func:`engine_adapter.narrow_to_operands`; with ``tag``, for each
            ``evaluated_tag`` without a content of its own). ``EvaluatedRequest.operands``
            says what was narrowed, or why nothing was.
        timeout_s: for the ``ListEvaluators`` call.

    Raises:
        evald.CallError: evald refused or could not be reached.
        ValueError: an unknown evaluator (the message lists the tenant's).
        engine_adapter.EvaluatedTagError: a bad ``evaluated_tag`` field (names it).
    """
    request = span_request(
        target,
        token,
        evaluators,
        tag=tag,
        prefix=prefix,
        at_least_one=at_least_one,
        special_tokens=special_tokens,
        send_target=send_target,
        operands_from=operands_from,
        timeout_s=timeout_s,
    )
    instructions = request.instructions(answer_prefix)
    return EvaluatedRequest(request.structural_tag, request.options, instructions, request.operands)


def lower_for_vllm(
    tag: Mapping[str, Any] | str,
    specs: Sequence[EvaluatorSpec],
    *,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_EXCLUDES,
) -> dict[str, Any]:
    """``tag`` with its ``evaluated_tag`` elements lowered (unchanged if it has none)."""
    return lowered_tag(tag, specs, special_tokens=special_tokens)


def computed_json_body(
    schema: Mapping[str, Any],
    token: str | None = None,
    target: str | None = None,
    *,
    operands_from: str | None = None,
) -> dict[str, Any]:
    """``extra_body`` (or raw JSON fields) for a request whose answer is one JSON document of
    ``schema``, its ``computed`` properties computed by the server (docs/computed-fields.md).

    Unlike spans, the schema is sent as written: the server lowers it with the tenant's
    evaluators and answers HTTP 400 naming the field if it cannot. ``token`` defaults to
    ``$EVALD_TOKEN``; ``operands_from`` is the text ``extracted`` properties are narrowed to.
    """
    body: dict[str, Any] = {"structured_outputs": {"json": dict(schema)}}
    options = request_option_values(token, target, operands_from=operands_from)
    if options:
        body["vllm_xargs"] = options
    return body
