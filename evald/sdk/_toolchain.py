"""Builds an evaluator module from its folder, in any of the SDK's languages, and embeds its
manifest.

One build for every module evald's side makes: ``evald build`` (a tenant's evaluator) and
``make wasm`` (the standard set in ``evaluators_wasm/src/``, and the ports in
``evaluators_wasm/ports/``). The language is the folder's source file (:data:`LANGUAGES`); Zig
and C compile with the pinned ``ziglang`` package, Rust with rustc (:mod:`evald.sdk._rust`),
AssemblyScript with asc (:mod:`evald.sdk._assemblyscript`). Every build is reproducible: the
same sources and the same compiler version give byte-identical modules, whatever the folder or
the compiler's cache. The manifest section's name and payload come from :mod:`evald.contract`,
which the host reads them by; a guest library never writes one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from evald.contract import (
    MANIFEST_SECTION,
    ErrorCode,
    EvaldError,
    append_custom_section,
    encode_manifest,
    load_manifest_source,
)
from evald.sdk._assemblyscript import ASSEMBLYSCRIPT_SOURCE, compile_assemblyscript, find_asc
from evald.sdk._compiler import BuildError
from evald.sdk._rust import RUST_SOURCE, compile_rust, find_rustc, refuse_dependencies

__all__ = [
    "GUEST_STACK_BYTES",
    "LANGUAGES",
    "ZIG_VERSION",
    "BuildError",
    "Compiled",
    "build_evaluator",
    "compile_folder",
    "compile_zig",
    "language_of",
    "with_manifest",
]

#: The ``ziglang`` release modules are built with (the ``sdk`` and ``dev`` extras pin it); the
#: same sources and this version give byte-identical modules.
ZIG_VERSION: Final = "0.14.1"
#: Source file (relative to the evaluator folder) per language, in the order a folder is read.
LANGUAGES: Final = {
    "zig": "main.zig",
    "c": "main.c",
    "rust": RUST_SOURCE,
    "assemblyscript": ASSEMBLYSCRIPT_SOURCE,
}
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


@dataclass(frozen=True)
class Compiled:
    """What a compiler made of a folder, before the manifest is embedded.

    Attributes:
        wasm: the module bytes.
        language: a key of :data:`LANGUAGES`.
        source: the compiled source file.
        toolchain: the compiler and its version, for people (``rustc 1.63.0 (/usr/bin/rustc)``).
        warnings: things that did not stop the build (an unpinned compiler version).
    """

    wasm: bytes
    language: str
    source: Path
    toolchain: str
    warnings: tuple[str, ...] = field(default=())


def language_of(folder: Path) -> str | None:
    """The language of the evaluator in ``folder`` (the first source file found), or None."""
    for language, source in LANGUAGES.items():
        if (folder / source).is_file():
            return language
    return None


def _zig_toolchain() -> tuple[str, list[str]]:
    if importlib.util.find_spec("ziglang") is None:
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"the Zig toolchain is not installed: run `pip install ziglang=={ZIG_VERSION}` "
            "(or install evald with the `sdk` extra)",
        )
    try:
        installed = importlib.metadata.version("ziglang")
    except importlib.metadata.PackageNotFoundError:
        installed = "unknown"
    if installed != ZIG_VERSION:
        return f"ziglang {installed}", [
            f"ziglang {installed} is installed; evald builds are pinned to {ZIG_VERSION} "
            f"(`pip install ziglang=={ZIG_VERSION}`), so this module may differ byte for byte "
            "from a pinned build"
        ]
    return f"ziglang {installed}", []


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


def compile_folder(folder: Path, *, cache_dir: Path | None = None) -> Compiled:
    """Finds the folder's language and its compiler, and compiles it (no manifest yet).

    Raises:
        BuildError: no source, or the compiler refused it.
        EvaldError: ``INVALID_ARGUMENT`` when the language's compiler is missing (the message
            says what to install and how).
    """
    folder = folder.resolve()
    language = language_of(folder)
    if language is None:
        sources = ", ".join(LANGUAGES.values())
        raise BuildError(f"{folder} has no evaluator source (one of {sources})")
    source = folder / LANGUAGES[language]
    if language == "rust":
        refuse_dependencies(folder)
        rust = find_rustc()
        wasm = compile_rust(folder, rust)
        return Compiled(wasm, language, source, rust.describe(), tuple(rust.warnings()))
    if language == "assemblyscript":
        asc = find_asc(folder)
        wasm = compile_assemblyscript(folder, asc)
        return Compiled(wasm, language, source, asc.describe(), tuple(asc.warnings()))
    zig, warnings = _zig_toolchain()
    wasm = compile_zig(source, cache_dir=cache_dir)
    return Compiled(wasm, language, source, zig, tuple(warnings))


def build_evaluator(folder: Path, *, cache_dir: Path | None = None) -> bytes:
    """Builds the folder's evaluator and embeds the folder's manifest.

    Raises:
        BuildError: no source, or the compiler refused it.
        EvaldError: ``INVALID_ARGUMENT`` when the language's compiler is missing.
    """
    return with_manifest(compile_folder(folder, cache_dir=cache_dir).wasm, folder)


def with_manifest(wasm: bytes, folder: Path) -> bytes:
    """``wasm`` with the folder's manifest (``manifest.json`` + ``grammar.ebnf``) embedded."""
    return append_custom_section(
        wasm, MANIFEST_SECTION, encode_manifest(load_manifest_source(folder))
    )
