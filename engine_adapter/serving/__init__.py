"""What an inference server's plugin shares, whichever engine it is (SGLang, vLLM).

The server's configuration from its environment (:class:`AdapterConfig`); what all evaluated
requests of one tenant share in a server process (:class:`AdapterRuntime`) and the tenants
themselves (:class:`TenantRuntimes`); a request's own options (tenant token, address,
evaluator names: :func:`request_options`); the bounded wait a decode step may spend on pending
spans (:class:`StepWaits`); the grammar bitmask's bit tests (:func:`allows`); the check that
the engine still has the internals a plugin patches (:func:`missing_internals`); a request's
JSON schema with computed properties, lowered with its tenant's evaluators where the server
compiles its grammar (:func:`lower_request_schema`). And the
client side of the same request: the one engine-neutral builder of its lowered tag and options
(:func:`span_request`), which the engines' request helpers only place.

Engine-neutral: nothing here imports an engine; the engines' plugins sit above it.
"""

from engine_adapter.serving._bitmask import allow_only, allows
from engine_adapter.serving._computed_request import lower_request_schema, needs_lowering
from engine_adapter.serving._internals import missing_internals, warn_if_other_version
from engine_adapter.serving._request_builder import (
    SpanRequest,
    chosen_evaluators,
    lowered_tag,
    request_option_values,
    span_request,
)
from engine_adapter.serving._request_options import (
    EXTRA_ARG_EVALUATORS,
    EXTRA_ARG_OPERANDS,
    EXTRA_ARG_TARGET,
    EXTRA_ARG_TOKEN,
    EXTRA_ARGS,
    RequestOptions,
    allowed_targets,
    rename_bindings,
    request_options,
)
from engine_adapter.serving._server_config import DEFAULT_DEADLINE_MS, AdapterConfig, ConfigError
from engine_adapter.serving._server_runtime import (
    AdapterRuntime,
    close_shared_clients,
    shared_client,
)
from engine_adapter.serving._step_wait import StepWaits
from engine_adapter.serving._tenant_runtimes import Tenancy, TenantRuntimes

__all__ = [
    "DEFAULT_DEADLINE_MS",
    "EXTRA_ARGS",
    "EXTRA_ARG_EVALUATORS",
    "EXTRA_ARG_OPERANDS",
    "EXTRA_ARG_TARGET",
    "EXTRA_ARG_TOKEN",
    "AdapterConfig",
    "AdapterRuntime",
    "ConfigError",
    "RequestOptions",
    "SpanRequest",
    "StepWaits",
    "Tenancy",
    "TenantRuntimes",
    "allow_only",
    "allowed_targets",
    "allows",
    "chosen_evaluators",
    "close_shared_clients",
    "lower_request_schema",
    "lowered_tag",
    "missing_internals",
    "needs_lowering",
    "rename_bindings",
    "request_option_values",
    "request_options",
    "shared_client",
    "span_request",
    "warn_if_other_version",
]
