"""The vLLM adapter: a vLLM plugin that evaluates spans through evald during decoding.

Install the adapter next to vLLM 0.32.0, set ``EVALD_TARGET`` (and ``EVALD_TOKEN``) and start
vLLM's OpenAI server: vLLM loads :func:`plugin.register` from the ``vllm.general_plugins`` entry
point in each of its processes, and the engine core's scheduler evaluates spans, forces results
through the grammar bitmask and holds a request whose value is pending out of the batch. Started
with ``--speculative-config`` naming the adapter's proposer (:func:`speculative_config` gives the
value), a whole result region goes through vLLM's verify step in one forward. Requests ask for
evaluation with :func:`evaluated_request`; a JSON schema with computed properties goes as it is
(:func:`computed_json_body`). See ``docs/vllm.md``.

Importing this package imports neither vLLM nor torch (the request helper runs on clients).
:class:`SpanTracker` is the engine's runtime: the evaluated requests of one scheduler (the
plugin builds one per scheduler; the real-server harness drives one without vLLM).
"""

from __future__ import annotations

from engine_adapter.serving import (
    EXTRA_ARG_EVALUATORS,
    EXTRA_ARG_TARGET,
    EXTRA_ARG_TOKEN,
)
from engine_adapter.vllm._tracker import SpanTracker
from engine_adapter.vllm.proposer import speculative_config
from engine_adapter.vllm.request import (
    EvaluatedRequest,
    computed_json_body,
    evaluated_request,
    lower_for_vllm,
)

__all__ = [
    "EXTRA_ARG_EVALUATORS",
    "EXTRA_ARG_TARGET",
    "EXTRA_ARG_TOKEN",
    "EvaluatedRequest",
    "SpanTracker",
    "computed_json_body",
    "evaluated_request",
    "lower_for_vllm",
    "speculative_config",
]
