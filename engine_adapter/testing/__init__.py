"""Real inference servers with the adapter loaded, for tests and benchmarks.

What the adapter's real-server tests, the lab's SGLang and vLLM benchmarks and an operator's own
integration tests need to run a server the way a user runs one: :mod:`engine_adapter.testing.sglang`
and :mod:`engine_adapter.testing.vllm` start the real server from its own venv with ``EVALD_*`` in
its environment (the engine loads the adapter through its plugin entry point) and wait until it
is healthy; this package holds what both share — SmolLM2 as a folder the servers load
(:func:`model_folder`), a structural tag whose span contents the caller fixes
(:func:`fixed_tag`), the spans of a reply (:func:`spans_in`), a daemon stopped for a block
(:func:`stopped`), an address that accepts and never answers (:class:`SilentAddress`), the
computed-field requests both servers are tested with (:data:`ESSAY_SCHEMA`,
:func:`checked_document`), the machine's CPUs split between the engine and evald
(:class:`CpuPartition`) and between tensor-parallel ranks (:func:`rank_cpu_lists`), and SmolLM2
with its attention heads padded so those ranks can split them
(:func:`tensor_parallel_model_folder`).

The evald daemon itself comes from :mod:`evald.testing`. Nothing in the adapter imports this
package; importing it imports neither SGLang nor vLLM.
"""

from __future__ import annotations

from engine_adapter.testing._common import (
    PLAIN_PROMPTS,
    SPAN,
    STALL_FACTOR,
    STALL_FLOOR_S,
    SilentAddress,
    fixed_tag,
    free_port,
    has_amx,
    longest_gap,
    model_folder,
    post,
    spans_in,
    stopped,
)
from engine_adapter.testing._computed_cases import (
    ECHO,
    ESSAY_PROMPT,
    ESSAY_SCHEMA,
    NARRATED_SCHEMA,
    POLICY,
    VERDICT,
    calc_value,
    checked_document,
    extraction_schema,
    http_error,
    numbers_in,
    policy_schema,
    unknown_evaluator_schema,
)
from engine_adapter.testing._padded_heads import tensor_parallel_model_folder
from engine_adapter.testing._server_runs import CpuPartition, rank_cpu_lists

__all__ = [
    "ECHO",
    "ESSAY_PROMPT",
    "ESSAY_SCHEMA",
    "NARRATED_SCHEMA",
    "PLAIN_PROMPTS",
    "POLICY",
    "SPAN",
    "STALL_FACTOR",
    "STALL_FLOOR_S",
    "VERDICT",
    "CpuPartition",
    "SilentAddress",
    "calc_value",
    "checked_document",
    "extraction_schema",
    "fixed_tag",
    "free_port",
    "has_amx",
    "http_error",
    "longest_gap",
    "model_folder",
    "numbers_in",
    "policy_schema",
    "post",
    "rank_cpu_lists",
    "spans_in",
    "stopped",
    "tensor_parallel_model_folder",
    "unknown_evaluator_schema",
]
