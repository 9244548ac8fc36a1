"""Where the daemon finds the standard evaluators' built modules: data, not code.

The modules ship in the guest package's ``wasm/`` folder (``evaluators_wasm``, which also holds
their sources, Python references and cases). The daemon reads the ``.wasm`` files and runs none
of that package's Python: ``importlib.util.find_spec`` locates a top-level package without
executing it, and an import-linter contract in pyproject.toml keeps ``evald`` from importing it
(docs/design.md §8).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from evald.contract import STANDARD_EVALUATORS

__all__ = ["GUEST_PACKAGE", "standard_module_paths"]

#: The distribution's package that holds the standard set's built modules.
GUEST_PACKAGE = "evaluators_wasm"


def standard_module_paths() -> dict[str, Path]:
    """Each standard evaluator's built module, by name (a path that may be missing: the registry
    logs and skips a standard module it cannot load). Empty when the package is not installed.
    """
    spec = importlib.util.find_spec(GUEST_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not locations:
        return {}
    folder = Path(locations[0]) / "wasm"
    return {name: folder / f"{name}.wasm" for name in STANDARD_EVALUATORS}
