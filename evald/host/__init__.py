"""The wasm host: runs one evaluator call under its limits (fuel, memory, deadline, stack).

It knows wasmtime, the ABI (docs/abi.md) and the limits, and nothing of tenants, gRPC or
engines: the daemon (``evald.daemon``), ``evald test`` (``evald.sdk``) and in-process
evaluation in the engine adapter all run evaluators through :class:`WasmHost`. Compilation of
untrusted modules runs in a separate, limited worker process (:class:`Compiler`).
"""

from __future__ import annotations

from evald.host._abi import (
    MAX_CODE_BYTES,
    MAX_FUNCTIONS,
    check_manifest_grammars,
    inspect_module,
    validate_module,
)
from evald.host._compile_cost import MAX_FUNCTION_BRANCHES, MAX_FUNCTION_LOCAL_BRANCHES
from evald.host._compiler import (
    DEFAULT_COMPILE_MEMORY_BYTES,
    CompiledModule,
    Compiler,
    compile_module,
    peek_manifest_section,
)
from evald.host._host import WasmHost
from evald.host._instance import MAX_TABLE_ELEMENTS
from evald.host._limits import HostConfig, Limits
from evald.host._loaded_module import LoadedModule
from evald.host._outcome import EvalOutcome

__all__ = [
    "DEFAULT_COMPILE_MEMORY_BYTES",
    "MAX_CODE_BYTES",
    "MAX_FUNCTIONS",
    "MAX_FUNCTION_BRANCHES",
    "MAX_FUNCTION_LOCAL_BRANCHES",
    "MAX_TABLE_ELEMENTS",
    "CompiledModule",
    "Compiler",
    "EvalOutcome",
    "HostConfig",
    "Limits",
    "LoadedModule",
    "WasmHost",
    "check_manifest_grammars",
    "compile_module",
    "inspect_module",
    "peek_manifest_section",
    "validate_module",
]
