"""Builds an evaluator module from its folder, in any of the SDK's languages, and embeds its
manifest.

One build for every module evald's side makes: ``evald build`` (a tenant's evaluator) and
``make wasm`` (the standard set in ``evaluators_wasm/src/``, and the ports in
``evaluators_wasm/ports/``). The language is the folder's source file (:data:`LANGUAGES`); Zig
and C compile with the pinned ``ziglang`` package, Rust with rustc (:mod:`evald.sdk._rust`),
AssemblyScript with asc (:mod:`evald.sdk._assemblyscript`), each compiler in the build's
sandbox (:mod:`evald.sdk._sandbox`: a folder is code that runs at build time, so it sees only
itself, the compiler and a scratch folder, under limits). Every build is reproducible: the
same sources and the same compiler version give byte-identical modules, whatever the folder or
the compiler's cache. The manifest section's name and payload come from :mod:`evald.contract`,
which the host reads them by; a guest library never writes one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from evald.contract import (
    MANIFEST_SECTION,
    ErrorCode,
    EvaldError,
    append_custom_section,
    encode_manifest,
    load_manifest_source,
)
from evald.sdk._assemblyscript import ASSEMBLYSCRIPT_SOURCE, compile_assemblyscript, find_asc
from evald.sdk._compiler import BuildError, Compiler
from evald.sdk._rust import RUST_SOURCE, compile_rust, find_rustc, refuse_dependencies
from evald.sdk._sandbox import BuildSandbox, Scratch

__all__ = [
    "GUEST_C",
    "GUEST_STACK_BYTES",
    "GUEST_ZIG",
    "LANGUAGES",
    "ZIG_VERSION",
    "BuildError",
    "Compiled",
    "build_evaluator",
    "compile_folder",
    "compile_zig",
    "find_zig",
    "language_of",
    "manifest_source",
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
#: The Zig guest library (``evald_json.zig``), importable from every Zig guest as
#: ``@import("evald_json")``: a module of the build, read from the SDK, never from the folder.
GUEST_ZIG: Final = Path(__file__).resolve().parent / "guest" / "zig"
#: The C guest library (``evald_json.h``, header-only), on every C guest's include path.
GUEST_C: Final = Path(__file__).resolve().parent / "guest" / "c"
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


def find_zig() -> tuple[Compiler, list[str]]:
    """The pinned Zig of the ``ziglang`` package (its ``zig`` binary, run directly), and a
    warning when another release is installed.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` when ``ziglang`` is not installed.
    """
    spec = importlib.util.find_spec("ziglang")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / "zig").is_file():
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"the Zig toolchain is not installed: run `pip install ziglang=={ZIG_VERSION}` "
            "(or install evald with the `sdk` extra)",
        )
    package = Path(locations[0]).resolve()
    try:
        installed = importlib.metadata.version("ziglang")
    except importlib.metadata.PackageNotFoundError:
        installed = "unknown"
    zig = Compiler("ziglang", str(package / "zig"), installed, ZIG_VERSION, needs=(package,))
    if installed != ZIG_VERSION:
        return zig, [
            f"ziglang {installed} is installed; evald builds are pinned to {ZIG_VERSION} "
            f"(`pip install ziglang=={ZIG_VERSION}`), so this module may differ byte for byte "
            "from a pinned build"
        ]
    return zig, []


def compile_zig(source: Path, zig: Compiler, scratch: Scratch) -> bytes:
    """Compiles one Zig (or C, by extension) file to a freestanding wasm32 module, in the
    build's sandbox (its caches in the scratch folder: nothing is shared between builds).

    Raises:
        BuildError: the compiler failed (its output attached) or a limit stopped it.
    """
    out = scratch.out / "module.wasm"
    cache = str(scratch.root / "cache")
    if source.suffix == ".c":
        cmd = [*zig.argv, "cc", "-target", "wasm32-freestanding", "-nostdlib",
               "-Wl,--no-entry", "-Wl,--export-dynamic", "-Os",
               f"-Wl,-z,stack-size={GUEST_STACK_BYTES}", "-I", str(GUEST_C),
               "-o", str(out), str(source)]  # fmt: skip
    else:  # the source is the root module; the guest library a module it may import
        cmd = [*zig.argv, "build-exe", *ZIG_FLAGS, "--dep", "evald_json",
               f"-Mroot={source}", f"-Mevald_json={GUEST_ZIG / 'evald_json.zig'}",
               f"-femit-bin={out}", "--cache-dir", cache, "--global-cache-dir", cache]  # fmt: skip
    scratch.run(
        cmd, what=source.name, cwd=source.parent, needs=(*zig.needs, GUEST_ZIG, GUEST_C),
        env={"ZIG_GLOBAL_CACHE_DIR": cache, "ZIG_LOCAL_CACHE_DIR": cache},
    )  # fmt: skip
    if not out.is_file():
        raise BuildError(f"compiling {source.name} failed: the compiler wrote no module")
    return out.read_bytes()


def compile_folder(folder: Path, *, sandbox: BuildSandbox | None = None) -> Compiled:
    """Finds the folder's language and its compiler, and compiles it (no manifest yet) in the
    build's sandbox (:mod:`evald.sdk._sandbox`; default :class:`BuildSandbox`: bwrap, the
    default limits, no compiler from the folder).

    Raises:
        BuildError: no source, the compiler refused it, or a limit stopped it.
        EvaldError: ``INVALID_ARGUMENT`` when the language's compiler or bwrap is missing (the
            message says what to install and how).
    """
    folder = folder.resolve()
    sandbox = sandbox or BuildSandbox()
    language = language_of(folder)
    if language is None:
        sources = ", ".join(LANGUAGES.values())
        raise BuildError(f"{folder} has no evaluator source (one of {sources})")
    source = folder / LANGUAGES[language]
    warnings: list[str] = []
    if language == "rust":
        refuse_dependencies(folder)
        compiler = find_rustc()
    elif language == "assemblyscript":
        compiler = find_asc(folder, from_folder=sandbox.toolchain_from_folder)
    else:
        compiler, warnings = find_zig()
    with Scratch(sandbox, folder) as scratch:
        if language == "rust":
            wasm = compile_rust(folder, compiler, scratch)
        elif language == "assemblyscript":
            wasm = compile_assemblyscript(folder, compiler, scratch)
        else:
            wasm = compile_zig(source, compiler, scratch)
    if language in ("zig", "c"):
        return Compiled(wasm, language, source, f"ziglang {compiler.version}", tuple(warnings))
    return Compiled(wasm, language, source, compiler.describe(), tuple(compiler.warnings()))


def build_evaluator(folder: Path, *, sandbox: BuildSandbox | None = None) -> bytes:
    """Builds the folder's evaluator in the build's sandbox and embeds the folder's manifest.

    Raises:
        BuildError: no source, the compiler refused it, or a limit stopped it.
        EvaldError: ``INVALID_ARGUMENT`` when the language's compiler or bwrap is missing, or
            a manifest file lies outside the folder.
    """
    return with_manifest(compile_folder(folder, sandbox=sandbox).wasm, folder)


def manifest_source(folder: Path) -> dict[str, Any]:
    """The folder's manifest (``manifest.json`` + ``grammar.ebnf``), read only from the folder's
    own regular files: these are read by the builder, outside the sandbox, and the grammar is
    text the daemon hands to every caller. A link that leads out of the folder would copy any
    file the builder can read into the module; a FIFO or a device would hang or flood the
    build.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` naming the file and what is wrong with it.
        OSError, json.JSONDecodeError, UnicodeDecodeError: as
            :func:`evald.contract.load_manifest_source`.
    """
    root = folder.resolve()
    for name in ("manifest.json", "grammar.ebnf"):
        path = root / name
        if not path.exists():
            continue
        target = path.resolve()
        if not target.is_relative_to(root):
            raise _usage(
                f"{path} leads to {target}, outside the evaluator folder; a build reads only "
                "the folder's own files (copy the file into the folder)"
            )
        if not target.is_file():
            raise _usage(f"{path} is not a regular file; a build reads only regular files")
    return load_manifest_source(root)


def _usage(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_ARGUMENT, message)


def with_manifest(wasm: bytes, folder: Path) -> bytes:
    """``wasm`` with the folder's manifest (:func:`manifest_source`) embedded.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` when a manifest file leads out of the folder.
    """
    return append_custom_section(wasm, MANIFEST_SECTION, encode_manifest(manifest_source(folder)))
