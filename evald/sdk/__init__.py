"""Writing evaluators: ``evald new``, ``evald build`` and ``evald test`` as a library.

It builds a guest in Zig or C (the pinned Zig toolchain), Rust (rustc for wasm32) or
AssemblyScript (asc) — :func:`build_evaluator`, also ``make wasm``'s build — checks a module
with the daemon's own validator and limits, and runs an evaluator's cases in process, so a
module that passes here registers (docs/writing-evaluators.md); a policy (a manifest with
``input_schema``/``result_schema``) is also held to its schemas (:func:`check_policy`). Rust
and AssemblyScript guests use the ABI's guest libraries shipped here (:data:`GUEST_CRATE`,
:data:`GUEST_PACKAGES`). A
folder is code that runs at build time: every compiler runs in a bwrap sandbox under limits
(:class:`BuildSandbox`, :class:`BuildLimits`), with the operator's compilers only.
"""

from __future__ import annotations

from evald.sdk._assemblyscript import (
    ASC_FLAGS,
    ASC_VERSION,
    CHECKOUT_ASC,
    GUEST_PACKAGES,
    find_asc,
)
from evald.sdk._compiler import BuildError
from evald.sdk._conformance import MALFORMED_INPUTS, PolicyReport, check_policy
from evald.sdk._rust import GUEST_CRATE, RUST_VERSION, find_rustc
from evald.sdk._sandbox import DEFAULT_LIMITS, BuildLimits, BuildSandbox, find_bwrap
from evald.sdk._sdk import (
    LANGUAGES,
    TEMPLATE_DIR,
    TEMPLATES,
    ZIG_VERSION,
    BuildResult,
    Case,
    CaseResult,
    DaemonSettings,
    build_folder,
    check_module,
    daemon_settings,
    grammar_warnings,
    load_cases,
    new_evaluator,
    run_cases,
    template_files,
)
from evald.sdk._toolchain import build_evaluator, compile_folder, language_of

__all__ = [
    "ASC_FLAGS",
    "ASC_VERSION",
    "CHECKOUT_ASC",
    "DEFAULT_LIMITS",
    "GUEST_CRATE",
    "GUEST_PACKAGES",
    "LANGUAGES",
    "MALFORMED_INPUTS",
    "RUST_VERSION",
    "TEMPLATES",
    "TEMPLATE_DIR",
    "ZIG_VERSION",
    "BuildError",
    "BuildLimits",
    "BuildResult",
    "BuildSandbox",
    "Case",
    "CaseResult",
    "DaemonSettings",
    "PolicyReport",
    "build_evaluator",
    "build_folder",
    "check_module",
    "check_policy",
    "compile_folder",
    "daemon_settings",
    "find_asc",
    "find_bwrap",
    "find_rustc",
    "grammar_warnings",
    "language_of",
    "load_cases",
    "new_evaluator",
    "run_cases",
    "template_files",
]
