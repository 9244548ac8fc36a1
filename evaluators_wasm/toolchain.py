"""Builds evaluator modules with the pinned Zig toolchain and embeds their manifest.

Shared by ``python -m evaluators_wasm.build`` (the standard set) and ``evald build`` (a tenant's
module), so both produce modules the same way. The build is reproducible: the same sources and
the same ``ziglang`` version give byte-identical modules, whatever the state of Zig's cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_SECTION",
    "BuildError",
    "append_custom_section",
    "build_evaluator",
    "compile_zig",
    "load_manifest_source",
]

MANIFEST_SECTION = "evald.manifest"
GUEST_STACK_BYTES = 64 * 1024
ZIG_FLAGS = (
    "-target",
    "wasm32-freestanding",
    "-fno-entry",
    "-rdynamic",
    "-O",
    "ReleaseSmall",
    "--stack",
    str(GUEST_STACK_BYTES),
)


class BuildError(Exception):
    """The compiler refused the source; ``output`` holds its diagnostics verbatim."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message + (f"\n{output}" if output else ""))
        self.output = output


def _leb128(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def append_custom_section(wasm: bytes, name: str, payload: bytes) -> bytes:
    """Returns ``wasm`` with a custom section appended (custom sections may follow any section)."""
    if wasm[:4] != b"\0asm":
        raise BuildError("not a WebAssembly module (missing the \\0asm magic)")
    encoded_name = name.encode()
    body = _leb128(len(encoded_name)) + encoded_name + payload
    return wasm + b"\x00" + _leb128(len(body)) + body


def compile_zig(source: Path, *, cache_dir: Path | None = None) -> bytes:
    """Compiles one Zig (or C, by extension) file to a freestanding wasm32 module.

    Raises:
        BuildError: the compiler failed; its output is attached.
    """
    with tempfile.TemporaryDirectory(prefix="evald-build-") as tmp:
        out = Path(tmp) / "module.wasm"
        if source.suffix == ".c":
            cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "wasm32-freestanding",
                   "-nostdlib", "-Wl,--no-entry", "-Wl,--export-dynamic", "-Os",
                   f"-Wl,-z,stack-size={GUEST_STACK_BYTES}", "-o", str(out), str(source)]
        else:
            cmd = [sys.executable, "-m", "ziglang", "build-exe", str(source), *ZIG_FLAGS,
                   f"-femit-bin={out}"]
            if cache_dir is not None:
                cmd += ["--cache-dir", str(cache_dir), "--global-cache-dir", str(cache_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=source.parent)
        if proc.returncode != 0 or not out.exists():
            raise BuildError(f"compiling {source.name} failed", proc.stderr + proc.stdout)
        return out.read_bytes()


def load_manifest_source(folder: Path) -> dict[str, Any]:
    """Reads ``manifest.json`` and, if present, ``grammar.ebnf`` (as ``input_grammar``)."""
    manifest: dict[str, Any] = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    grammar_file = folder / "grammar.ebnf"
    if grammar_file.exists():
        manifest["input_grammar"] = grammar_file.read_text(encoding="utf-8")
    manifest.setdefault("abi", 1)
    return manifest


def build_evaluator(folder: Path, *, cache_dir: Path | None = None) -> bytes:
    """Builds ``folder/main.zig`` (or ``main.c``) and embeds the folder's manifest."""
    source = folder / "main.zig"
    if not source.exists():
        source = folder / "main.c"
    if not source.exists():
        raise BuildError(f"{folder} has neither main.zig nor main.c")
    wasm = compile_zig(source, cache_dir=cache_dir)
    manifest = load_manifest_source(folder)
    payload = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return append_custom_section(wasm, MANIFEST_SECTION, payload)
