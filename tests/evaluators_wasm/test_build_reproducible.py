"""The committed modules are what their sources build: a change to a grammar, a manifest or a
guest that was not rebuilt (``make wasm``) fails here, and so does a change to the SDK's build
that would give other bytes. The same holds for the ports (``evaluators_wasm/ports/``), built
by rustc and asc: rebuilt from a copy in another folder, with the pinned compilers, they give
the committed bytes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toolchains import require_toolchain

from evald.contract import (
    MANIFEST_SECTION,
    STANDARD_EVALUATORS,
    encode_manifest,
    load_manifest_source,
)
from evaluators_wasm import PORTS, PORTS_DIR, SOURCE_DIR, WASM_DIR, port_path, wasm_path

ROOT = Path(__file__).resolve().parents[2]


def test_the_guest_package_holds_exactly_the_standard_set() -> None:
    """The contract's names, the source folders and the built modules are the same set."""
    sources = {path.name for path in SOURCE_DIR.iterdir() if path.is_dir()}
    built = {path.stem for path in WASM_DIR.glob("*.wasm")}
    assert sources == built == set(STANDARD_EVALUATORS)


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_committed_module_embeds_the_source_manifest(name: str) -> None:
    """The manifest section (the build appends it last) holds manifest.json + grammar.ebnf."""
    payload = encode_manifest(load_manifest_source(SOURCE_DIR / name))
    module = wasm_path(name).read_bytes()
    assert module.endswith(MANIFEST_SECTION.encode() + payload), (
        f"{wasm_path(name).name} does not embed the current sources' manifest: run make wasm"
    )


def test_make_wasm_rebuilds_every_module_byte_identically(tmp_path: Path) -> None:
    """``make wasm``'s command, into a temporary folder, gives the committed bytes."""
    pytest.importorskip("ziglang")
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_wasm.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    differ = [
        name
        for name in STANDARD_EVALUATORS
        if (tmp_path / f"{name}.wasm").read_bytes() != wasm_path(name).read_bytes()
    ]
    assert not differ, f"rebuilding gives other bytes for {differ}: run make wasm"


@pytest.mark.parametrize("name", sorted(PORTS))
def test_each_port_rebuilds_byte_identically_from_another_folder(
    name: str, tmp_path: Path
) -> None:
    """Paths are remapped out of the Rust build, and asc embeds none: a copy of the port's
    folder elsewhere builds the committed module."""
    from evald.sdk import ASC_VERSION, RUST_VERSION, build_evaluator

    language = PORTS[name][1]
    toolchain = require_toolchain(language)
    pinned = RUST_VERSION if language == "rust" else ASC_VERSION
    if f" {pinned} " not in f"{toolchain} ":
        pytest.skip(f"{toolchain} is not the pinned {pinned}: other compilers give other bytes")
    copy = tmp_path / "elsewhere" / name
    shutil.copytree(PORTS_DIR / name, copy, ignore=shutil.ignore_patterns("*.wasm", "node_modules"))
    assert build_evaluator(copy) == port_path(name).read_bytes(), (
        f"rebuilding {name} gives other bytes: run make ports"
    )


@pytest.mark.parametrize("name", sorted(PORTS))
def test_each_port_holds_the_standard_checksum_grammar(name: str) -> None:
    """A port's grammar is a copy (a build reads only its folder's own files, and a link out
    of the folder is refused), kept the same as the Zig module's."""
    grammar = PORTS_DIR / name / "grammar.ebnf"
    assert not grammar.is_symlink()
    assert grammar.read_bytes() == (SOURCE_DIR / "checksum" / "grammar.ebnf").read_bytes()
