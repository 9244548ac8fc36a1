"""The committed modules are what their sources build: a change to a grammar, a manifest or a
guest that was not rebuilt (``python -m evaluators_wasm.build NAME``) fails here."""

from __future__ import annotations

import json

import pytest

from evaluators_wasm import SOURCE_DIR, STANDARD_EVALUATORS, wasm_path
from evaluators_wasm.toolchain import MANIFEST_SECTION, build_evaluator, load_manifest_source


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_committed_module_embeds_the_source_manifest(name: str) -> None:
    """The manifest section (the build appends it last) holds manifest.json + grammar.ebnf."""
    payload = json.dumps(load_manifest_source(SOURCE_DIR / name), sort_keys=True,
                         separators=(",", ":")).encode()
    module = wasm_path(name).read_bytes()
    assert module.endswith(MANIFEST_SECTION.encode() + payload), (
        f"{wasm_path(name).name} does not embed the current sources' manifest: "
        f"run python -m evaluators_wasm.build {name}")


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_rebuild_is_byte_identical(name: str) -> None:
    pytest.importorskip("ziglang")
    assert build_evaluator(SOURCE_DIR / name) == wasm_path(name).read_bytes(), (
        f"rebuilding {name} gives other bytes: run python -m evaluators_wasm.build {name}")
