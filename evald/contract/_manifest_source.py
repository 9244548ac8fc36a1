"""An evaluator's manifest as its source folder holds it, and as its module's section holds it.

An evaluator folder (``evald new`` writes one; ``evaluators_wasm/src/NAME/`` are the standard
set's) keeps the manifest in ``manifest.json`` and its input grammar in ``grammar.ebnf``.
``evald build`` embeds the two as one canonical JSON document in the ``evald.manifest`` section;
the engine adapter reads the standard set's manifests from the same folders when no daemon is
running. One reader and one encoder here, so the module's section and what the adapter reads
from the sources are the same document (the standard set's rebuild test compares the bytes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from evald.contract._abi import ABI_VERSION

__all__ = ["encode_manifest", "load_manifest_source"]


def load_manifest_source(folder: Path) -> dict[str, Any]:
    """``folder/manifest.json`` with ``folder/grammar.ebnf`` (if present) as ``input_grammar``
    and ``abi`` defaulted to this ABI.

    Raises:
        OSError: ``manifest.json`` cannot be read.
        json.JSONDecodeError, UnicodeDecodeError: it is not JSON text.
    """
    manifest: dict[str, Any] = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    grammar_file = folder / "grammar.ebnf"
    if grammar_file.exists():
        manifest["input_grammar"] = grammar_file.read_text(encoding="utf-8")
    manifest.setdefault("abi", ABI_VERSION)
    return manifest


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    """The manifest section's payload: compact JSON with sorted keys (a reproducible build)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
