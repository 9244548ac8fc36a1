"""The evaluator ABI v1 (docs/abi.md): the structural checks of a module.

:func:`validate_module` runs every check that needs no instance: size, WebAssembly validity,
no imports, the required exports with their exact types, one memory whose minimum fits the
memory cap, and the manifest (parsed by :func:`evald.contract.parse_manifest`, the same rules a
client reads an evaluator's description by). It is shared by the daemon (``RegisterEvaluator`` and
start-up reload, through :class:`evald.host.WasmHost.load`, which then also compiles and
trial-instantiates) and by ``evald build``, so a module that builds is a module that registers.

Every refusal is an :class:`~evald.contract.EvaldError` with ``ErrorCode.INVALID_MODULE``
and a message that names the rule and, where possible, the fix.
"""

from __future__ import annotations

import re
from typing import Final

import wasmtime

from evald.contract import (
    BUFFER_EXPORTS,
    EVAL_EXPORT,
    MANIFEST_SECTION,
    VERSION_EXPORT,
    ErrorCode,
    EvaldError,
    Manifest,
    parse_manifest,
)
from evald.host._instrument import RESERVED_EXPORT_PREFIX
from evald.host._limits import HostConfig, Limits
from evald.host._wasm_binary import FuncType, ModuleInfo, WasmFormatError, parse_module

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "DEFAULT_MAX_MODULE_BYTES",
    "MAX_CODE_BYTES",
    "MAX_FUNCTIONS",
    "WASM_PAGE_BYTES",
    "check_manifest_grammars",
    "inspect_module",
    "validate_module",
]

WASM_PAGE_BYTES: Final = 65536
DEFAULT_MAX_MODULE_BYTES: Final = HostConfig().module_bytes
DEFAULT_MAX_MEMORY_BYTES: Final = Limits().memory_bytes
#: Compile-cost caps. wasmtime cannot interrupt a compilation, and its cost grows with the number
#: of functions and the bytes of code, not with the module's size alone: a 1.2 MB module of 60,000
#: tiny functions took a minute of the daemon's CPU on a busy 2-core machine. The standard
#: evaluators have at most 102 functions and 50 KB of code.
MAX_FUNCTIONS: Final = 10_000
MAX_CODE_BYTES: Final = 1 * 2**20

_I32 = 0x7F
_GETTER = FuncType((), (_I32,))
_EVAL = FuncType((_I32,), (_I32,))
_REQUIRED_FUNCTIONS: Final = {
    VERSION_EXPORT: _GETTER,
    **dict.fromkeys(BUFFER_EXPORTS, _GETTER),
    EVAL_EXPORT: _EVAL,
}

_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def _refuse(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_MODULE, message)


def check_manifest_grammars(manifest: Manifest) -> bool:
    """Compiles the manifest's grammar and regex with XGrammar, if XGrammar is installed, and
    each rule its ``literals`` names as a grammar root.

    XGrammar is not a daemon dependency (the engine adapter compiles the grammars it uses);
    this is the stricter check for ``evald build`` and for hosts that have it. Importing it
    loads ``tvm_ffi``, which replaces the process's SIGSEGV handler: harmless for a
    :class:`~evald.host.WasmHost` with the default ``signals_based_traps=False``.

    Returns:
        True when both compiled, False when XGrammar is not installed (nothing was checked).

    Raises:
        EvaldError: ``INVALID_MODULE`` with XGrammar's diagnostic.
    """
    try:
        import xgrammar
    except Exception:  # not installed, or installed without a usable torch
        return False
    for label, build, text in (
        ("input_grammar", xgrammar.Grammar.from_ebnf, manifest.input_grammar),
        ("result_regex", xgrammar.Grammar.from_regex, manifest.result_regex),
    ):
        try:
            build(text)
        except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
            detail = str(exc).strip().splitlines()
            # drop XGrammar's "[12:51:33] /project/cpp/grammar_parser.cc:820: " source location
            reason = _XGRAMMAR_LOCATION.sub("", detail[-1]) if detail else repr(exc)
            raise _refuse(
                f"manifest field {label} does not compile with XGrammar: {reason}"
            ) from exc
    for rule in manifest.literals:
        # A literal rule is narrowed on its own (docs/abi.md, Manifest): it must be a grammar
        # of its own when made the root.
        try:
            xgrammar.Grammar.from_ebnf(manifest.input_grammar, root_rule_name=rule)
        except Exception as exc:
            detail = str(exc).strip().splitlines()
            reason = _XGRAMMAR_LOCATION.sub("", detail[-1]) if detail else repr(exc)
            raise _refuse(
                f"manifest literals: the rule {rule!r} does not compile as a grammar root "
                f"with XGrammar: {reason}"
            ) from exc
    return True


_VALIDATION_ENGINE: wasmtime.Engine | None = None


def _validation_engine() -> wasmtime.Engine:
    global _VALIDATION_ENGINE
    if _VALIDATION_ENGINE is None:
        from evald.host._engine import make_engine_config

        _VALIDATION_ENGINE = wasmtime.Engine(make_engine_config(HostConfig(), pooling=False))
    return _VALIDATION_ENGINE


def inspect_module(
    wasm: bytes,
    *,
    max_module_bytes: int = DEFAULT_MAX_MODULE_BYTES,
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    engine: wasmtime.Engine | None = None,
) -> tuple[Manifest, ModuleInfo]:
    """:func:`validate_module`, also returning the parsed declarations (for the host).

    The rules run in the order a module's author meets them, each group a function of its
    own: the bytes (size, magic, validity), what the module may hold (no imports, bounded
    functions and code), the ABI's exports, its memory, its manifest section.
    """
    _check_bytes(wasm, max_module_bytes, engine)
    try:
        info = parse_module(bytes(wasm))
    except WasmFormatError as exc:
        raise _refuse(f"cannot read the module: {exc}") from exc
    _check_contents(info)
    _check_exports(info)
    _check_memory(info, max_memory_bytes)
    return _manifest(wasm, info), info


def _check_bytes(wasm: bytes, max_module_bytes: int, engine: wasmtime.Engine | None) -> None:
    """Bytes, within the size cap, starting with the magic number, valid for this host."""
    if not isinstance(wasm, bytes | bytearray):
        raise _refuse("the module must be bytes")
    if len(wasm) > max_module_bytes:
        raise _refuse(
            f"the module is {len(wasm)} bytes; the module size cap is "
            f"{max_module_bytes} bytes (build with -O ReleaseSmall, strip debug "
            "sections, or ask for a larger cap)"
        )
    if wasm[:4] != b"\0asm":
        raise _refuse(
            "not a WebAssembly module: it does not start with the \\0asm magic "
            "number (upload the compiled .wasm file, not source or text)"
        )
    try:
        wasmtime.Module.validate(engine or _validation_engine(), bytes(wasm))
    except wasmtime.WasmtimeError as exc:
        detail = str(exc).strip().splitlines()
        raise _refuse(
            "not valid WebAssembly for this host: " + "; ".join(line.strip() for line in detail[:3])
        ) from exc


def _check_contents(info: ModuleInfo) -> None:
    """No imports; at most :data:`MAX_FUNCTIONS` functions and :data:`MAX_CODE_BYTES` of code."""
    if info.imports:
        listed = ", ".join(f"{i.module}.{i.name} ({i.kind})" for i in info.imports[:5])
        more = f" and {len(info.imports) - 5} more" if len(info.imports) > 5 else ""
        raise _refuse(
            f"the module imports {listed}{more}; an evaluator may import nothing "
            "(ABI v1: no clock, randomness, I/O or host calls). For Zig, build with "
            "-target wasm32-freestanding and avoid std.os/std.time"
        )

    functions = len(info.function_types)
    if functions > MAX_FUNCTIONS:
        raise _refuse(
            f"the module defines {functions} functions; at most {MAX_FUNCTIONS} are compiled "
            "(an evaluator needs far fewer: build with -O ReleaseSmall)"
        )
    code = info.section(10)
    code_bytes = code.end - code.content_start if code is not None else 0
    if code_bytes > MAX_CODE_BYTES:
        raise _refuse(
            f"the module has {code_bytes} bytes of code; at most {MAX_CODE_BYTES} are compiled "
            "(build with -O ReleaseSmall and strip unused code)"
        )


def _check_exports(info: ModuleInfo) -> None:
    """The ABI's exports, each of its type; none with the host's reserved prefix."""
    exports = {export.name: export for export in info.exports}
    reserved = sorted(name for name in exports if name.startswith(RESERVED_EXPORT_PREFIX))
    if reserved:
        raise _refuse(
            f"export name(s) {', '.join(reserved)} use the prefix "
            f"{RESERVED_EXPORT_PREFIX}, which is reserved for the host"
        )
    missing = [name for name in ("memory", *_REQUIRED_FUNCTIONS) if name not in exports]
    if missing:
        raise _refuse(
            f"the module does not export {', '.join(missing)}; ABI v1 requires "
            "memory, evald_abi_version, evald_input_ptr, evald_input_cap, "
            "evald_output_ptr, evald_output_cap and evald_eval (with Zig, mark them "
            "`export fn` and build with -rdynamic)"
        )
    for name, expected in _REQUIRED_FUNCTIONS.items():
        export = exports[name]
        if export.kind != "func":
            raise _refuse(
                f"export {name} is a {export.kind}; it must be a function of type "
                f"{expected.describe()}"
            )
        actual = info.function_type(export.index)
        if actual != expected:
            got = actual.describe() if actual else "an unknown type"
            raise _refuse(f"export {name} has type {got}; ABI v1 requires {expected.describe()}")
    if exports["memory"].kind != "memory":
        raise _refuse(
            f"export memory is a {exports['memory'].kind}; it must be the module's linear memory"
        )


def _check_memory(info: ModuleInfo, max_memory_bytes: int) -> None:
    """Exactly one plain 32-bit memory whose declared minimum fits the memory cap."""
    if len(info.memories) != 1:
        raise _refuse(
            f"the module defines {len(info.memories)} memories; ABI v1 requires exactly one"
        )
    memory = info.memories[0]
    if memory.shared or memory.memory64:
        raise _refuse("the memory must be a plain 32-bit, unshared memory")
    minimum_bytes = memory.minimum_pages * WASM_PAGE_BYTES
    if minimum_bytes > max_memory_bytes:
        raise _refuse(
            f"the memory's declared minimum is {memory.minimum_pages} pages "
            f"({minimum_bytes} bytes), above the memory cap of {max_memory_bytes} "
            "bytes; lower the initial memory (for Zig, --initial-memory or fewer "
            "static buffers)"
        )


def _manifest(wasm: bytes, info: ModuleInfo) -> Manifest:
    """The manifest of the module's one manifest section."""
    sections = info.custom_sections(MANIFEST_SECTION)
    if not sections:
        raise _refuse(
            f"the module has no {MANIFEST_SECTION} custom section; build it with "
            "`evald build` (or evald.contract.append_custom_section)"
        )
    if len(sections) > 1:
        raise _refuse(
            f"the module has {len(sections)} {MANIFEST_SECTION} sections; exactly one is allowed"
        )
    section = sections[0]
    return parse_manifest(bytes(wasm[section.payload_start : section.end]))


def validate_module(
    wasm: bytes,
    *,
    max_module_bytes: int = DEFAULT_MAX_MODULE_BYTES,
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    engine: wasmtime.Engine | None = None,
) -> Manifest:
    """Checks ``wasm`` against ABI v1 without instantiating it and returns its manifest.

    Parameters:
        wasm: the module bytes.
        max_module_bytes: the module size cap (``HostConfig.module_bytes``).
        max_memory_bytes: the memory cap the declared minimum must fit (``Limits.memory_bytes``).
        engine: the engine whose feature set decides validity; by default one configured like
            the daemon's host. Validation only: nothing is compiled or run.

    Raises:
        EvaldError: ``INVALID_MODULE`` with the first rule the module breaks.
    """
    manifest, _ = inspect_module(
        wasm, max_module_bytes=max_module_bytes, max_memory_bytes=max_memory_bytes, engine=engine
    )
    return manifest
