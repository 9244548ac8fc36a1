"""What one server request asks of the adapter besides its spans: its tenant (token, evald
address) and the evaluators its span tags name. One reading for both server plugins.

The options travel with the request, as flat string values:

- vLLM: ``SamplingParams.extra_args`` (over HTTP ``vllm_xargs``);
- SGLang: ``SamplingParams.custom_params`` (over HTTP the request's ``custom_params``, in
  ``/generate``'s ``sampling_params`` or at the top level of the OpenAI-compatible API).

The keys:

- ``evald_token``: the tenant's bearer token. A request that names none is evaluated for the
  server's own tenant (``EVALD_TOKEN``) when it goes to the server's own address, and with no
  token anywhere else: the server's token is never sent to another address. A named token that
  is empty, blank or malformed (``evald.contract.token_problem``) is refused with
  ``permission_denied``, never read as "no token";
- ``evald_target``: evald's address (default: the server's ``EVALD_TARGET``); it must be that
  address or one listed in ``EVALD_ALLOWED_TARGETS``, so that a request cannot point the server
  at an arbitrary host;
- ``evald_evaluators``: ``TAG=NAME`` pairs separated by commas, for evaluators whose tag differs
  from their name (the request helpers fill it in; without it a span is sent to the evaluator
  named like its opener, ``<calc>`` → ``calc``);
- ``evald_operands_from``: for a JSON schema with ``"extracted": true`` properties, the text
  whose literals they are narrowed to (typically the user's message; docs/computed-fields.md).
  The server lowers such a schema itself, so the text travels with the request.

A bad option never fails the request: its spans answer ``<result_error>CODE</result_error>``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.spans import SpanBinding
from evald.contract import ErrorCode, token_problem

__all__ = [
    "EXTRA_ARGS",
    "EXTRA_ARG_EVALUATORS",
    "EXTRA_ARG_OPERANDS",
    "EXTRA_ARG_TARGET",
    "EXTRA_ARG_TOKEN",
    "RequestOptions",
    "allowed_targets",
    "has_request_options",
    "rename_bindings",
    "request_options",
]

EXTRA_ARG_TARGET = "evald_target"
EXTRA_ARG_TOKEN = "evald_token"
EXTRA_ARG_EVALUATORS = "evald_evaluators"
EXTRA_ARG_OPERANDS = "evald_operands_from"
EXTRA_ARGS = (EXTRA_ARG_TARGET, EXTRA_ARG_TOKEN, EXTRA_ARG_EVALUATORS, EXTRA_ARG_OPERANDS)

_PAIR = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.:-]*)\s*=\s*([A-Za-z_][A-Za-z0-9_.:-]*)\s*")


@dataclass(frozen=True)
class RequestOptions:
    """The adapter's reading of one request."""

    bindings: tuple[SpanBinding, ...]
    config: AdapterConfig
    """The server's settings with this request's target and token."""
    refusal: tuple[str, str] | None = None
    """``(code, message)`` every span of the request answers with, for an unusable option."""


def allowed_targets(
    config: AdapterConfig, environ: Mapping[str, str] | None = None
) -> frozenset[str]:
    """``EVALD_TARGET`` plus the comma-separated ``EVALD_ALLOWED_TARGETS``."""
    env = os.environ if environ is None else environ
    extra = (t.strip() for t in env.get("EVALD_ALLOWED_TARGETS", "").split(","))
    return frozenset({config.target, *(t for t in extra if t)})


def request_options(
    extra: Mapping[str, Any] | None,
    bindings: tuple[SpanBinding, ...],
    config: AdapterConfig,
    allowed: frozenset[str],
) -> RequestOptions:
    """The options of a request whose spans are ``bindings``.

    Parameters:
        extra: the request's per-request values (``extra_args`` / ``custom_params``), if any.
        bindings: the spans its structural tag holds.
        config: the server's settings (:meth:`AdapterConfig.from_env`).
        allowed: the targets a request may name (:func:`allowed_targets`).
    """
    extra = extra if isinstance(extra, Mapping) else {}
    refusal: tuple[str, str] | None = None
    target = extra.get(EXTRA_ARG_TARGET, config.target)
    names = extra.get(EXTRA_ARG_EVALUATORS)
    if not isinstance(target, str) or target.strip() not in allowed:
        shown = repr(target) if len(repr(target)) <= 80 else repr(target)[:77] + "..."
        refusal = (
            ErrorCode.PERMISSION_DENIED,
            f"{EXTRA_ARG_TARGET}={shown} is not an evald address this server may use "
            f"(EVALD_TARGET or EVALD_ALLOWED_TARGETS: {', '.join(sorted(allowed))})",
        )
        target = config.target
    target = target.strip()
    token: str | None
    if EXTRA_ARG_TOKEN in extra:
        token = extra[EXTRA_ARG_TOKEN]
        problem = token_problem(token)
        if problem is not None:
            refusal = refusal or (
                ErrorCode.PERMISSION_DENIED,
                f"{EXTRA_ARG_TOKEN} {problem}: a request that names a token must name a "
                "valid one (leave the key out for the server's own tenant)",
            )
            token = None
    else:  # the server's own token belongs to the server's own address only
        token = config.token if target == config.target else None
    if names is not None:
        renamed = rename_bindings(bindings, names)
        if renamed is None:
            refusal = refusal or (
                ErrorCode.INVALID_ARGUMENT,
                f"{EXTRA_ARG_EVALUATORS}: expected TAG=NAME pairs separated by commas",
            )
        else:
            bindings = renamed
    return RequestOptions(
        bindings=bindings,
        config=replace(config, target=target, token=token),
        refusal=refusal,
    )


def has_request_options(extra: Mapping[str, Any] | None) -> bool:
    """Whether ``extra`` sets any of the adapter's keys."""
    return isinstance(extra, Mapping) and any(key in extra for key in EXTRA_ARGS)


def rename_bindings(
    bindings: tuple[SpanBinding, ...], names: Any
) -> tuple[SpanBinding, ...] | None:
    """``bindings`` with the evaluators ``names`` (``TAG=NAME,...``) gives; None if malformed."""
    if not isinstance(names, str):
        return None
    mapping: dict[str, str] = {}
    for part in names.split(","):
        if not part.strip():
            continue
        match = _PAIR.fullmatch(part)
        if match is None:
            return None
        mapping[f"<{match.group(1)}>"] = match.group(2)
    return tuple(
        replace(b, evaluator=mapping[b.begin]) if b.begin in mapping else b for b in bindings
    )
