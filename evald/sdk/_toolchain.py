"""Builds an evaluator module with the pinned Zig toolchain and embeds its manifest.

One build for every module evald's side makes: ``evald build`` (a tenant's evaluator) and
``make wasm`` (the standard set in ``evaluators_wasm/src/``, through ``evald build``). The build
is reproducible: the same sources and the same ``ziglang`` version give byte-identical modules,
whatever the state of Zig's cache. The manifest section's name and payload come from
:mod:`evald.contract`, which the host reads them by.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from evald.contract import (
    MANIFEST_SECTION,
    append_custom_section,
    encode_manifest,
    load_manifest_source,
)

__all__ = ["GUEST_STACK_BYTES", "BuildError", "build_evaluator", "compile_zig"]

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


def build_evaluator(folder: Path, *, cache_dir: Path | None = None) -> bytes:
    """Builds ``folder/main.zig`` (or ``main.c``) and embeds the folder's manifest.

    Raises:
        BuildError: no source, or the compiler refused it.
    """
    source = folder / "main.zig"
    if not source.exists():
        source = folder / "main.c"
    if not source.exists():
        raise BuildError(f"{folder} has neither main.zig nor main.c")
    wasm = compile_zig(source, cache_dir=cache_dir)
    return append_custom_section(
        wasm, MANIFEST_SECTION, encode_manifest(load_manifest_source(folder))
    )
