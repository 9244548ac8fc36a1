"""docs/semantics.md and docs/semantics/NAME.md say what the manifests say: the index row of each
evaluator names its tag, semantics version and module version, and a document that prints the
model grammar prints the one in grammar.ebnf."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evald.contract import STANDARD_EVALUATORS
from evaluators_wasm import SOURCE_DIR

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _manifest(name: str) -> dict[str, str]:
    manifest: dict[str, str] = json.loads((SOURCE_DIR / name / "manifest.json").read_text("utf-8"))
    return manifest


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_index_row_matches_the_manifest(name: str) -> None:
    manifest = _manifest(name)
    rows = [line for line in (DOCS / "semantics.md").read_text("utf-8").splitlines()
            if line.startswith(f"| [{name}](semantics/{name}.md) |")]
    assert len(rows) == 1, f"docs/semantics.md has no row for {name}"
    cells = [cell.strip() for cell in rows[0].split(" | ")]
    assert cells[1:4] == [f"`<{manifest['tag']}>`", f"`{manifest['semantics_version']}`",
                          manifest["version"]]


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_document_states_the_version_and_prints_the_grammar(name: str) -> None:
    text = (DOCS / "semantics" / f"{name}.md").read_text("utf-8")
    assert f"`{_manifest(name)['semantics_version']}`" in text
    grammar = (SOURCE_DIR / name / "grammar.ebnf").read_text("utf-8")
    blocks = re.findall(r"```[a-z]*\n(root ::= .*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1, f"docs/semantics/{name}.md should print its grammar once"
    if "…" not in blocks[0]:  # an abridged grammar (units lists its unit names in the text)
        assert blocks[0] == grammar
    else:
        assert blocks[0].splitlines()[:2] == grammar.splitlines()[:2]
