"""The evaluator SDK behind ``evald new``, ``evald build`` and ``evald test``.

A tenant's evaluator is a folder (``evald new`` makes one from the template)::

    the guest            main.zig, main.c, src/lib.rs (Rust, with Cargo.toml) or
                         assembly/index.ts (AssemblyScript, with package.json)
    manifest.json        name, version, tag, semantics version, description, result regex
    grammar.ebnf         the input grammar (XGrammar EBNF, root rule ``root``)
    cases.jsonl          {"input": ..., "value": ...} or {"input": ..., "error": CODE} per line

Rust and AssemblyScript guests use the SDK's guest libraries (``guest/``: the ``evald-guest``
crate and package), which the build finds inside the SDK (docs/writing-evaluators.md).

Nothing here re-implements a rule of the daemon: :func:`check_module` runs the daemon's own load
path (:meth:`evald.host.WasmHost.load`: size cap, ABI exports, no imports, manifest, compile,
trial instantiation) with the host settings and tenant limits ``evald serve`` would derive from
the same config (:func:`evald.daemon.host_config`, :func:`evald.daemon.host_limits`), then the
registry's reserved-name rule (:func:`evald.daemon.check_not_reserved`), then XGrammar on the
grammar and regex (:func:`evald.host.check_manifest_grammars`), which the daemon does not need
installed. So a module that passes ``evald build`` registers, unless it clashes with
another module of the same tenant (only the daemon knows those).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from evald.contract import (
    GUEST_ERROR_CODES,
    ErrorCode,
    EvaldError,
    Manifest,
    may_produce,
)
from evald.daemon import Config, load_config
from evald.host import EvalOutcome, HostConfig, Limits, WasmHost, check_manifest_grammars
from evald.sdk._new import TEMPLATE_DIR, TEMPLATES, new_evaluator, template_files
from evald.sdk._sandbox import BuildSandbox
from evald.sdk._toolchain import (
    LANGUAGES,
    ZIG_VERSION,
    compile_folder,
    language_of,
    manifest_source,
    with_manifest,
)

__all__ = [
    "LANGUAGES",
    "TEMPLATES",
    "TEMPLATE_DIR",
    "ZIG_VERSION",
    "BuildResult",
    "Case",
    "CaseResult",
    "DaemonSettings",
    "build_folder",
    "check_module",
    "daemon_settings",
    "grammar_warnings",
    "load_cases",
    "new_evaluator",
    "run_cases",
    "template_files",
]

_KNOWN_CODES: Final = {code.value for code in ErrorCode}


def _usage(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_ARGUMENT, message)


# -- the daemon's settings ------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonSettings:
    """The host settings and one tenant's limits, as ``evald serve`` derives them from a config.

    Attributes:
        host: engine settings (no disk cache: nothing is written next to the daemon's state).
        limits: the tenant's per-evaluation limits.
        tenant: whose limits (``None``: the config's default limits, no tenant named).
        source: the config file they came from.
    """

    host: HostConfig
    limits: Limits
    tenant: str | None
    source: str

    def describe(self) -> str:
        """One line for people: whose limits, and the main numbers."""
        who = f"tenant {self.tenant}" if self.tenant else "the default limits"
        limits = self.limits
        return (
            f"{who} of {self.source}: fuel {limits.fuel or 'unmetered'}, deadline "
            f"{limits.deadline_ms} ms, memory {_size(limits.memory_bytes)}, input "
            f"{_size(limits.input_bytes)}, output {_size(limits.output_bytes)}, module cap "
            f"{_size(self.host.module_bytes)}"
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def daemon_settings(config: str | Path | None = None, tenant: str | None = None) -> DaemonSettings:
    """Reads a daemon config the way ``evald serve`` does and picks a tenant's limits.

    Parameters:
        config: the config file; ``None`` means ``$EVALD_CONFIG``, else the packaged default.
        tenant: whose limits; ``None`` means the token-less tenant if there is one (``local`` in
            the default config), else the config's ``[defaults.limits]``.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` for an unreadable config or an unknown tenant.
    """
    from evald.daemon import ConfigError, host_config, host_limits

    try:
        loaded: Config = load_config(config)
    except ConfigError as exc:
        raise _usage(str(exc)) from None
    chosen = None
    if tenant is not None:
        chosen = loaded.tenant(tenant)
        if chosen is None:
            names = ", ".join(t.name for t in loaded.tenants) or "none"
            raise _usage(f"{loaded.source} has no tenant {tenant!r} (tenants: {names})")
    else:
        chosen = next((t for t in loaded.tenants if t.tokenless), None)
    limits = host_limits(chosen.limits if chosen else loaded.default_limits)
    return DaemonSettings(
        host=host_config(loaded.host, None),
        limits=limits,
        tenant=chosen.name if chosen else None,
        source=loaded.source,
    )


# -- evald build ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildResult:
    """A built and checked module.

    Attributes:
        wasm: the module bytes (manifest embedded).
        manifest: its manifest.
        sha256: hex SHA-256 of ``wasm`` (the daemon's identity for it).
        path: where it was written (``None`` when not written).
        source: the compiled source file (``None`` when a ready ``.wasm`` was checked).
        grammars_checked: XGrammar compiled the input grammar and the result regex (``False``
            when the check was skipped or XGrammar is not installed).
        input_cap, output_cap: the guest's buffer capacities, as the host read them.
        seconds: wall time of compile and checks.
        warnings: things that did not stop the build but deserve a look.
        language: the guest's language (a key of ``LANGUAGES``; "" for a ready ``.wasm``).
        toolchain: the compiler that built it, with its version.
    """

    wasm: bytes
    manifest: Manifest
    sha256: str
    path: Path | None
    source: Path | None
    grammars_checked: bool
    input_cap: int
    output_cap: int
    seconds: float
    warnings: tuple[str, ...] = field(default=())
    language: str = ""
    toolchain: str = ""


_NON_ASCII_BEFORE_HEX = re.compile(r"[^\x00-\x7f][0-9a-fA-F]")


def grammar_warnings(manifest: Manifest) -> list[str]:
    """What a scan of the manifest's grammar and regex finds that the daemon does not check.

    (``<`` in the input grammar's or the result regex's language is not a warning: the daemon
    refuses it at load, :mod:`evald.contract._alphabet`.)

    * an EBNF string literal with a non-ASCII character followed by a hex digit (``"°C"``):
      XGrammar 0.2.7 re-reads cached grammars from their printed form and such a literal comes
      back changed; write ``"°" "C"`` instead.
    """
    warnings: list[str] = []
    _, literals = may_produce(manifest.input_grammar, "<", regex=False)
    for literal in literals:
        if _NON_ASCII_BEFORE_HEX.search(literal):
            warnings.append(
                f"the input grammar's literal {literal!r} has a non-ASCII character followed "
                "by a hex digit, which XGrammar 0.2.7 misreads from its grammar cache; split "
                'it into two literals (e.g. "°" "C")'
            )
    return warnings


def check_module(
    wasm: bytes,
    settings: DaemonSettings | None = None,
    *,
    check_grammars: bool = True,
) -> tuple[Manifest, int, int, bool]:
    """Checks a module exactly as the daemon will at registration, plus XGrammar.

    Returns:
        (manifest, input_cap, output_cap, grammars_checked).

    Raises:
        EvaldError: ``INVALID_MODULE`` (the validator, or XGrammar refused the grammar or regex)
            or ``INVALID_ARGUMENT`` (the name or tag is reserved).
    """
    from evald.daemon import check_not_reserved

    settings = settings or daemon_settings()
    with WasmHost(settings.host) as host:
        loaded = host.load(wasm, limits=settings.limits)
    manifest = loaded.manifest
    check_not_reserved(manifest.name, manifest.tag)
    checked = check_manifest_grammars(manifest) if check_grammars else False
    return manifest, loaded.input_cap, loaded.output_cap, checked


def _check_source(folder: Path) -> None:
    if not folder.is_dir():
        raise _usage(f"{folder} is not a folder (expected an evaluator folder from `evald new`)")
    if language_of(folder) is None:
        raise _usage(
            f"{folder} has no evaluator source: main.zig, main.c, src/lib.rs (Rust) or "
            "assembly/index.ts (AssemblyScript)"
        )


def _write_atomically(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def build_folder(
    folder: Path,
    *,
    out: Path | None = None,
    settings: DaemonSettings | None = None,
    check_grammars: bool = True,
    write: bool = True,
    sandbox: BuildSandbox | None = None,
) -> BuildResult:
    """Compiles an evaluator folder, embeds its manifest and checks it.

    Parameters:
        folder: holds the guest's source (``LANGUAGES``), ``manifest.json`` and
            ``grammar.ebnf``.
        out: where to write the module; default ``folder/NAME.wasm``.
        settings: the daemon settings to check against (default: :func:`daemon_settings`).
        check_grammars: also compile the grammar and regex with XGrammar (if installed;
            importing it takes seconds).
        write: write the module (only when every check passed).
        sandbox: how the compilers run (default :class:`BuildSandbox`: in bwrap, under the
            default limits, never a compiler from the folder).

    Raises:
        BuildError: the compiler refused the source (``output`` holds its
            diagnostics verbatim), or a limit of the build's sandbox stopped it.
        EvaldError: a missing file, compiler or bwrap (``INVALID_ARGUMENT``, saying what to
            install), a manifest file outside the folder, an unreadable manifest, or any check
            that failed.
    """
    started = time.perf_counter()
    folder = folder.resolve()  # the compiler runs inside the folder
    _check_source(folder)
    if not (folder / "manifest.json").is_file():
        raise _usage(f"{folder} has no manifest.json")
    try:
        manifest_source(folder)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EvaldError(
            ErrorCode.INVALID_MODULE, f"{folder / 'manifest.json'} is not valid JSON: {exc}"
        ) from None
    compiled = compile_folder(folder, sandbox=sandbox)
    wasm = with_manifest(compiled.wasm, folder)
    manifest, input_cap, output_cap, checked = check_module(
        wasm, settings, check_grammars=check_grammars
    )
    warnings = [*compiled.warnings, *grammar_warnings(manifest)]
    path = None
    if write:
        path = out or folder / f"{manifest.name}.wasm"
        _write_atomically(path, wasm)
    return BuildResult(
        wasm=wasm,
        manifest=manifest,
        sha256=hashlib.sha256(wasm).hexdigest(),
        path=path,
        source=compiled.source,
        grammars_checked=checked,
        input_cap=input_cap,
        output_cap=output_cap,
        seconds=time.perf_counter() - started,
        warnings=tuple(warnings),
        language=compiled.language,
        toolchain=compiled.toolchain,
    )


# -- evald test -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One line of a cases file: an input and the value or guest error code it must give."""

    line: int
    input: str
    value: str | None
    error: str | None
    note: str = ""


@dataclass(frozen=True)
class CaseResult:
    """One case run under the daemon's host and limits; ``problem`` is empty when it passed."""

    case: Case
    outcome: EvalOutcome
    problem: str

    @property
    def passed(self) -> bool:
        return not self.problem


def load_cases(path: Path) -> list[Case]:
    """Reads a JSON-lines cases file; blank lines are skipped.

    Each line is an object with ``input`` (a string) and exactly one of ``value`` (the expected
    value) or ``error`` (an error code such as ``syntax``); ``note`` is optional.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` naming the file, line and what is wrong.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise _usage(f"cannot read the cases file {path}: {exc}") from None
    cases = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _usage(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(data, dict) or not isinstance(data.get("input"), str):
            raise _usage(f'{where}: expected an object with a string "input"')
        unknown = sorted(set(data) - {"input", "value", "error", "note"})
        if unknown:
            raise _usage(f"{where}: unknown key(s) {', '.join(unknown)}")
        value, error = data.get("value"), data.get("error")
        if (value is None) == (error is None):
            raise _usage(f'{where}: give exactly one of "value" or "error"')
        if value is not None and not isinstance(value, str):
            raise _usage(f'{where}: "value" must be a string')
        if error is not None and error not in _KNOWN_CODES:
            guest = ", ".join(sorted(code.value for code in GUEST_ERROR_CODES))
            raise _usage(
                f"{where}: unknown error code {error!r} (guest codes: {guest}; docs/abi.md "
                "lists the host's)"
            )
        cases.append(Case(number, data["input"], value, error, str(data.get("note", ""))))
    if not cases:
        raise _usage(f"{path} holds no cases")
    return cases


def _regex_checker(result_regex: str) -> re.Pattern[str] | None:
    try:
        return re.compile(result_regex)
    except re.error:  # XGrammar-only syntax: the engine's grammar still checks it
        return None


def run_cases(
    wasm: bytes, cases: Sequence[Case], settings: DaemonSettings | None = None
) -> list[CaseResult]:
    """Runs each case in this process under the daemon's host settings and a tenant's limits.

    A value must also match the manifest's ``result_regex``: the engine replaces one that does
    not with ``guest_fault``, since the grammar would refuse its tokens.

    Raises:
        EvaldError: ``INVALID_MODULE`` when the module does not load.
    """
    settings = settings or daemon_settings()
    results = []
    with WasmHost(settings.host) as host:
        module = host.load(wasm, limits=settings.limits)
        value_check = _regex_checker(module.manifest.result_regex)
        pool_key = settings.tenant or ""
        for case in cases:
            outcome = host.evaluate(
                module, case.input.encode("utf-8"), settings.limits, pool_key=pool_key
            )
            got = repr(outcome.value) if outcome.error is None else f"error {outcome.error.value}"
            problem = ""
            if case.value is not None and outcome.value != case.value:
                problem = f"expected {case.value!r}, got {got}"
            elif case.error is not None and (
                outcome.error is None or outcome.error.value != case.error
            ):
                problem = f"expected error {case.error}, got {got}"
            elif (
                outcome.value is not None
                and value_check is not None
                and value_check.fullmatch(outcome.value) is None
            ):
                problem = (
                    f"the value {outcome.value!r} does not match the manifest's result_regex "
                    "(the engine would answer guest_fault)"
                )
            results.append(CaseResult(case, outcome, problem))
    return results
