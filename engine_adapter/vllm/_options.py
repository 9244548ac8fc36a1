"""What one vLLM request asks of the adapter: its spans (from the structural tag) and its tenant.

A request is evaluated when its structural tag (``structured_outputs.structural_tag``, or the
OpenAI ``response_format``) holds spans in the lowered form that
:func:`engine_adapter.build_structural_tag` and :func:`engine_adapter.lower_evaluated_tags` emit.
Its tenant comes from ``SamplingParams.extra_args`` (over HTTP ``vllm_xargs``), read as
:mod:`engine_adapter.serving._request_options` says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine_adapter.serving import AdapterConfig, RequestOptions
from engine_adapter.serving import request_options as _options_of
from engine_adapter.spans import SpanBinding, find_lowered_spans

__all__ = ["evaluated_spans", "request_options"]


def evaluated_spans(sampling_params: Any) -> tuple[SpanBinding, ...] | None:
    """The evaluated spans of a request's structural tag, or ``None`` when it has none.

    Parameters:
        sampling_params: the request's ``vllm.SamplingParams``.
    """
    structured = getattr(sampling_params, "structured_outputs", None)
    raw_tag = getattr(structured, "structural_tag", None) if structured is not None else None
    if not raw_tag:
        return None
    try:
        tag = json.loads(raw_tag) if isinstance(raw_tag, str) else raw_tag
    except ValueError:
        return None  # vLLM's own validation answers for bad JSON
    if not isinstance(tag, Mapping) or "structures" in tag:
        return None  # legacy structural tags carry JSON schemas only
    try:
        bindings = find_lowered_spans(tag, None)
    except ValueError:
        return None  # one opener with two shapes: left to the grammar alone
    return tuple(bindings) or None


def request_options(
    sampling_params: Any, config: AdapterConfig, allowed: frozenset[str]
) -> RequestOptions | None:
    """The options of a request, or ``None`` when its structural tag has no evaluated span
    (how the tracker's :class:`~engine_adapter.serving.TenantRuntimes` reads it).

    Parameters:
        sampling_params: the request's ``vllm.SamplingParams``.
        config: the server's settings (:meth:`AdapterConfig.from_env`).
        allowed: the targets a request may name (``allowed_targets``).
    """
    bindings = evaluated_spans(sampling_params)
    if bindings is None:
        return None
    extra = getattr(sampling_params, "extra_args", None) or {}
    return _options_of(extra, bindings, config, allowed)
