"""SDK subcommands: ``new``, ``build`` and ``test`` (a tenant's own evaluator, before ``register``).

Exit statuses: 0 success; 1 ``evald test`` ran and some case did not give what it expected
(or a policy broke its manifest's schemas);
2 the command could not do its job (bad arguments, a compile error, a module the daemon would
refuse), printed as ``error: CODE: message`` on stderr like the client commands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from evald.cli import EXIT_ERROR, EXIT_OK, Runner, command

if TYPE_CHECKING:
    from evald.contract import EvaldError
    from evald.sdk import (
        BuildError,
        BuildResult,
        BuildSandbox,
        CaseResult,
        DaemonSettings,
        PolicyReport,
    )

__all__ = ["add_build_options", "build_for_cli", "build_sandbox", "print_failure"]

EXIT_MISMATCH = 1


def _fail(code: str, message: str) -> int:
    print(f"error: {code}: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_ERROR


def print_failure(exc: BuildError | EvaldError) -> int:
    """Prints a compile failure's diagnostics verbatim, then ``error: CODE: message``; returns
    the exit status (2)."""
    from evald.sdk import BuildError

    if isinstance(exc, BuildError):
        if exc.output:
            sys.stderr.write(exc.output if exc.output.endswith("\n") else exc.output + "\n")
        first = str(exc).splitlines()[0]
        above = " (compiler output above)" if exc.output.strip() else ""
        return _fail("invalid_module", first + above)
    return _fail(exc.code.value, exc.message)


def _guarded(run: Runner) -> Runner:
    def wrapper(args: argparse.Namespace) -> int:
        from evald.contract import EvaldError
        from evald.sdk import BuildError

        try:
            return run(args)
        except (BuildError, EvaldError) as exc:
            return print_failure(exc)

    return wrapper


def _add_daemon_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("daemon settings to check against")
    group.add_argument(
        "--config",
        metavar="FILE",
        help="the daemon's TOML config (default: $EVALD_CONFIG, else the packaged default, "
        "as `evald serve` reads it)",
    )
    group.add_argument(
        "--tenant",
        metavar="NAME",
        help="apply this tenant's limits (default: the token-less tenant, `local`)",
    )


def add_build_options(parser: argparse.ArgumentParser, *, short_timeout: bool = True) -> None:
    """The build sandbox's options (``build``, ``test`` and ``register`` of a folder);
    ``--timeout`` is also ``--build-timeout`` where the command has no timeout of its own
    (``register``'s is the call's)."""
    from evald.sdk import DEFAULT_LIMITS

    group = parser.add_argument_group(
        "the build's sandbox (a folder is code that runs at build time; docs/"
        "writing-evaluators.md, 'Building a tenant's folder')"
    )
    group.add_argument(
        *(["--timeout"] if short_timeout else []),
        "--build-timeout",
        dest="build_timeout",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_LIMITS.timeout_s,
        help="wall clock for the whole build; then every process of it is killed "
        "(default %(default)g)",
    )
    group.add_argument(
        "--cpu-seconds",
        type=int,
        metavar="N",
        default=DEFAULT_LIMITS.cpu_s,
        help="CPU seconds per compiler process (default %(default)d)",
    )
    group.add_argument(
        "--memory-mib",
        type=int,
        metavar="MIB",
        default=DEFAULT_LIMITS.memory_bytes >> 20,
        help="heap and writable memory per compiler process, in MiB (default %(default)d)",
    )
    group.add_argument(
        "--unsandboxed",
        action="store_true",
        help="DANGEROUS: build without bwrap, only for sources you trust (the folder's "
        "compile-time code then reads what you can read and reaches the network; the limits "
        "and the clean environment still apply)",
    )
    group.add_argument(
        "--toolchain-from-folder",
        action="store_true",
        help="DANGEROUS: take asc from the folder's own node_modules (the folder then chooses "
        "the program that compiles it; it still runs in the sandbox)",
    )


def build_sandbox(args: argparse.Namespace) -> BuildSandbox:
    """The sandbox the options of :func:`add_build_options` ask for.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` for a limit that is not positive.
    """
    from evald.contract import ErrorCode, EvaldError
    from evald.sdk import BuildLimits, BuildSandbox

    if args.build_timeout <= 0 or args.cpu_seconds <= 0 or args.memory_mib <= 0:
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            "--build-timeout, --cpu-seconds and --memory-mib must be positive",
        )
    limits = BuildLimits(
        timeout_s=args.build_timeout, cpu_s=args.cpu_seconds, memory_bytes=args.memory_mib << 20
    )
    return BuildSandbox(
        limits=limits,
        unsandboxed=args.unsandboxed,
        toolchain_from_folder=args.toolchain_from_folder,
    )


def _settings(args: argparse.Namespace) -> DaemonSettings:
    from evald.sdk import daemon_settings

    return daemon_settings(args.config, args.tenant)


def build_for_cli(
    folder: Path,
    settings: DaemonSettings | None = None,
    *,
    out: Path | None = None,
    check_grammars: bool = True,
    quiet: bool = False,
    sandbox: BuildSandbox | None = None,
) -> BuildResult:
    """Builds ``folder`` for a command and reports it on stdout (shared with ``register``).

    ``settings`` defaults to the daemon config ``evald serve`` would read and its token-less
    tenant's limits; ``sandbox`` to the default sandbox and limits.
    """
    from evald.sdk import build_folder

    if sandbox is not None and sandbox.unsandboxed:
        print(
            "warning: --unsandboxed: the folder's compilers run with your file access and network",
            file=sys.stderr,
        )
    result = build_folder(
        folder, out=out, settings=settings, check_grammars=check_grammars, sandbox=sandbox
    )
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not quiet:
        manifest = result.manifest
        print(
            f"built {manifest.name} {manifest.version} -> {result.path} ({len(result.wasm)} "
            f"bytes, sha256 {result.sha256[:12]}, {result.seconds:.1f} s, {result.toolchain})"
        )
    return result


@command("new", "Create an evaluator folder from the template (source, manifest, cases).", order=33)
def _new(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("name", metavar="NAME", help="the evaluator's name and tag, e.g. roman")
    parser.add_argument(
        "--lang",
        choices=("zig", "c", "rust", "assemblyscript"),
        default="zig",
        help="guest language (default zig; rust needs rustc for wasm32, assemblyscript asc)",
    )
    parser.add_argument(
        "--template",
        choices=("evaluator", "policy"),
        default="evaluator",
        help="evaluator (default: span text in, a value out) or policy (one JSON object in, "
        "one JSON value out, with the SDK's JSON library and the manifest's schemas)",
    )
    parser.add_argument(
        "--dir", type=Path, metavar="DIR", help="folder to create (default: ./NAME)"
    )

    @_guarded
    def run(args: argparse.Namespace) -> int:
        from evald.sdk import new_evaluator

        folder: Path = args.dir or Path(args.name)
        files = new_evaluator(args.name, folder, args.lang, args.template)
        shown = [path.relative_to(folder).as_posix() for path in files]
        print(f"created {folder}/ ({args.lang}, {args.template}): {', '.join(shown)}")
        print(
            f"next: edit {shown[0]} and grammar.ebnf, then `evald build {folder}`, "
            f"`evald test {folder}`, `evald register {folder}`"
        )
        return EXIT_OK

    return run


@command("build", "Compile an evaluator folder and check it as the daemon will.", order=34)
def _build(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("path", metavar="PATH", type=Path, help="the evaluator folder")
    parser.add_argument(
        "-o", "--out", type=Path, metavar="FILE", help="output module (default: PATH/NAME.wasm)"
    )
    parser.add_argument(
        "--no-grammar-check",
        action="store_true",
        help="skip compiling the grammar and regex with XGrammar (it takes seconds to import)",
    )
    _add_daemon_options(parser)
    add_build_options(parser)

    @_guarded
    def run(args: argparse.Namespace) -> int:
        settings = _settings(args)
        result = build_for_cli(
            args.path,
            settings,
            out=args.out,
            check_grammars=not args.no_grammar_check,
            sandbox=build_sandbox(args),
        )
        if result.grammars_checked:
            grammar_note = "input grammar and result regex compile with XGrammar"
        elif args.no_grammar_check:
            grammar_note = "XGrammar check skipped (--no-grammar-check)"
        else:
            grammar_note = "XGrammar not installed: grammar and regex not compiled"
        print(
            "checked as the daemon will: ABI v1 exports, no imports, manifest, size cap, "
            f"compile and trial instantiation under {settings.describe()}; name and tag not "
            f"reserved; {grammar_note}"
        )
        print(
            f"buffers: input {result.input_cap} bytes, output {result.output_cap} bytes; "
            f"span <{result.manifest.tag}>...</{result.manifest.tag}>"
        )
        return EXIT_OK

    return run


@command("test", "Run an evaluator's cases in-process under the daemon's limits.", order=35)
def _test(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "path", metavar="PATH", type=Path, help="an evaluator folder (built first) or a .wasm"
    )
    parser.add_argument(
        "cases",
        metavar="CASES",
        type=Path,
        nargs="?",
        help="JSON-lines cases (default: PATH/cases.jsonl for a folder)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per case")
    _add_daemon_options(parser)
    add_build_options(parser)

    @_guarded
    def run(args: argparse.Namespace) -> int:
        from evald.sdk import check_policy, load_cases, run_cases

        path: Path = args.path
        cases_path: Path | None = args.cases
        settings = _settings(args)
        if path.is_dir():
            cases_path = cases_path or path / "cases.jsonl"
            cases = load_cases(cases_path)
            wasm = build_for_cli(
                path, settings, check_grammars=False, quiet=args.json, sandbox=build_sandbox(args)
            ).wasm
        else:
            if cases_path is None:
                return _fail("invalid_argument", "give the cases file: evald test MODULE CASES")
            cases = load_cases(cases_path)
            try:
                wasm = path.read_bytes()
            except OSError as exc:
                return _fail("invalid_argument", f"cannot read {path}: {exc.strerror}")
        results = run_cases(wasm, cases, settings)
        policy = check_policy(wasm, settings, [(f"cases line {c.line}", c.input) for c in cases])
        failed = sum(1 for result in results if not result.passed)
        failed += len(policy.problems) if policy else 0
        if args.json:
            import json

            for result in results:
                outcome = result.outcome
                print(
                    json.dumps(
                        {
                            "line": result.case.line,
                            "input": result.case.input,
                            "value": outcome.value,
                            "error": outcome.error.value if outcome.error else None,
                            "message": outcome.message,
                            "fuel_used": outcome.fuel_used,
                            "elapsed_us": outcome.elapsed_us,
                            "passed": result.passed,
                            "problem": result.problem,
                        }
                    )
                )
            if policy:
                print(json.dumps({"conformance": {"checks": policy.checks,
                                                  "problems": list(policy.problems)}}))  # fmt: skip
            return EXIT_MISMATCH if failed else EXIT_OK
        _print_table(results, cases_path, settings)
        if policy:
            _print_policy(policy)
        return EXIT_MISMATCH if failed else EXIT_OK

    return run


def _print_table(
    results: list[CaseResult], cases_path: Path | None, settings: DaemonSettings
) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=str(cases_path), caption=f"under {settings.describe()}")
    table.add_column("line", justify="right")
    table.add_column("input", overflow="fold")
    table.add_column("result", overflow="fold")
    table.add_column("fuel", justify="right")
    table.add_column("µs", justify="right")
    table.add_column("check", overflow="fold")
    for result in results:
        outcome = result.outcome
        shown = (
            outcome.value
            if outcome.error is None
            else f"{outcome.error.value}: {outcome.message}".rstrip(": ")
        )
        table.add_row(
            str(result.case.line),
            escape(repr(result.case.input)),
            escape(str(shown)),
            str(outcome.fuel_used),
            str(outcome.elapsed_us),
            "[green]ok[/]" if result.passed else f"[red]FAIL[/] {escape(result.problem)}",
        )
    console = Console()
    console.print(table)
    failed = sum(1 for result in results if not result.passed)
    summary = f"{len(results) - failed} passed, {failed} failed"
    console.print(f"[red]{summary}[/]" if failed else f"[green]{summary}[/]")


def _print_policy(report: PolicyReport) -> None:
    """The policy conformance check's outcome: each problem, then a summary line."""
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    for problem in report.problems:
        console.print(f"[red]FAIL[/] conformance: {escape(problem)}")
    if report.passed:
        console.print(
            f"[green]conformance: {report.checks} checks passed[/] (examples against "
            "input_schema and result_schema, case values, malformed JSON refused)"
        )
    else:
        console.print(f"[red]conformance: {len(report.problems)} problem(s)[/]")
