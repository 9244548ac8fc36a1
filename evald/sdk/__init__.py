"""Writing evaluators: ``evald new``, ``evald build`` and ``evald test`` as a library.

It builds with the pinned Zig toolchain (:func:`build_evaluator`, also ``make wasm``'s build),
checks a module with the daemon's own validator and limits, and runs an evaluator's cases in
process, so a module that passes here registers (docs/writing-evaluators.md).
"""

from __future__ import annotations

from evald.sdk._sdk import (
    LANGUAGES,
    TEMPLATE_DIR,
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
)
from evald.sdk._toolchain import BuildError, build_evaluator

__all__ = [
    "LANGUAGES",
    "TEMPLATE_DIR",
    "ZIG_VERSION",
    "BuildError",
    "BuildResult",
    "Case",
    "CaseResult",
    "DaemonSettings",
    "build_evaluator",
    "build_folder",
    "check_module",
    "daemon_settings",
    "grammar_warnings",
    "load_cases",
    "new_evaluator",
    "run_cases",
]
