"""Client subcommands: ``call``, ``evaluators``, ``register``, ``unregister``, ``hash-token``."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from evald.cli import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, Runner, add_client_options, command

if TYPE_CHECKING:
    from evald.client import Client

__all__: list[str] = []


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(code: str, message: str) -> int:
    print(f"error: {code}: {_one_line(message)}", file=sys.stderr)
    return EXIT_ERROR


def _client(args: argparse.Namespace) -> Client:
    from evald.client import Client

    return Client(
        args.target,
        args.token,
        timeout_s=args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def _guarded(run: Runner) -> Runner:
    """Turns a CallError into the shared exit statuses (1 unreachable, 2 refused)."""

    def wrapper(args: argparse.Namespace) -> int:
        from evald.client import CallError

        try:
            return run(args)
        except CallError as error:
            if error.unreachable:
                print(f"error: unreachable: {_one_line(error.message)}", file=sys.stderr)
                return EXIT_UNREACHABLE
            assert error.code is not None
            return _fail(error.code.value, error.message)

    return wrapper


_CALL_HELP = "Evaluate one span: print its value, or `error: CODE: message` (exit 2)."


@command("call", _CALL_HELP, order=20)
def _call(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("tag", metavar="TAG", help="evaluator name or tag (calc, strop, ...)")
    parser.add_argument("input", metavar="INPUT", help="the span content; `-` reads stdin")
    parser.add_argument(
        "--deadline-ms", type=int, default=0, help="per-evaluation deadline (default: tenant's)"
    )
    parser.add_argument("--json", action="store_true", help="print the whole response as JSON")
    add_client_options(parser)

    @_guarded
    def run(args: argparse.Namespace) -> int:
        data = sys.stdin.buffer.read() if args.input == "-" else args.input.encode("utf-8")
        with _client(args) as client:
            response = client.evaluate(args.tag, data, deadline_ms=args.deadline_ms)
        if args.json:
            from google.protobuf import json_format

            print(json_format.MessageToJson(response, indent=None))
            return EXIT_OK if response.WhichOneof("outcome") == "value" else EXIT_ERROR
        if response.WhichOneof("outcome") == "value":
            print(response.value)
            return EXIT_OK
        from evald.contract import ErrorCode

        code = ErrorCode.from_proto(response.error.code).value
        return _fail(code, response.error.message)

    return run


@command("evaluators", "List the evaluators your tenant may call.", order=30)
def _evaluators(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument(
        "--grammar", action="store_true", help="also show input grammars and result regexes"
    )
    add_client_options(parser)

    @_guarded
    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            evaluators = client.list_evaluators()
        if args.json:
            from google.protobuf import json_format

            for info in evaluators:
                print(json_format.MessageToJson(info, indent=None))
            return EXIT_OK
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"evaluators at {client.target}")
        for column in ("name", "tag", "version", "semantics", "owner", "description"):
            table.add_column(column, overflow="fold")
        for info in evaluators:
            table.add_row(
                info.name,
                f"<{info.tag}>",
                info.version,
                info.semantics_version,
                info.owner,
                info.description,
                end_section=False,
            )
        console = Console()
        console.print(table)
        if args.grammar:
            for info in evaluators:
                console.rule(f"{info.name}: input grammar, then result regex")
                console.print(info.input_grammar, markup=False, highlight=False)
                console.print(info.result_regex, markup=False, highlight=False)
        return EXIT_OK

    return run


@command("register", "Register a module (docs/abi.md) for your tenant.", order=40)
def _register(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "path",
        metavar="PATH",
        type=Path,
        help="the .wasm module, or an evaluator folder (built and checked first, as by "
        "`evald build`)",
    )
    parser.add_argument("--replace", action="store_true", help="replace a module of that name")
    parser.add_argument(
        "--no-grammar-check",
        action="store_true",
        help="when building a folder, skip compiling its grammar with XGrammar",
    )
    add_client_options(parser)
    from evald.cli._sdk import add_build_options

    add_build_options(parser, short_timeout=False)

    @_guarded
    def run(args: argparse.Namespace) -> int:
        if args.path.is_dir():
            from evald.cli._sdk import build_for_cli, build_sandbox, print_failure
            from evald.contract import EvaldError
            from evald.sdk import BuildError

            try:
                module = build_for_cli(
                    args.path,
                    check_grammars=not args.no_grammar_check,
                    sandbox=build_sandbox(args),
                ).wasm
            except (BuildError, EvaldError) as exc:
                return print_failure(exc)
        else:
            try:
                module = args.path.read_bytes()
            except OSError as exc:
                return _fail("invalid_argument", f"cannot read {args.path}: {exc.strerror}")
        with _client(args) as client:
            info = client.register(module, replace=args.replace)
        print(
            f"registered {info.name} {info.version} (<{info.tag}>, {info.semantics_version}, "
            f"sha256 {info.sha256[:12]})"
        )
        return EXIT_OK

    return run


@command("unregister", "Delete one of your tenant's modules.", order=41)
def _unregister(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument("name", metavar="NAME", help="the evaluator's name")
    add_client_options(parser)

    @_guarded
    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            client.delete(args.name)
        print(f"unregistered {args.name}")
        return EXIT_OK

    return run


@command("hash-token", "Make a tenant token and the token_sha256 line for the config.", order=60)
def _hash_token(parser: argparse.ArgumentParser) -> Runner:
    parser.add_argument(
        "token",
        nargs="?",
        metavar="TOKEN",
        help="hash this token (`-` reads it from stdin); default: generate a new random one",
    )
    parser.add_argument("--json", action="store_true", help="print {token, token_sha256}")

    def run(args: argparse.Namespace) -> int:
        from evald.daemon import hash_token

        if args.token == "-":
            token = sys.stdin.readline().strip()
        else:
            token = args.token or secrets.token_urlsafe(32)
        if not token:
            return _fail("invalid_argument", "empty token")
        digest = hash_token(token)
        if args.json:
            print(json.dumps({"token": token, "token_sha256": digest}))
            return EXIT_OK
        if not args.token:
            print(f"# the token (give it to the tenant; the daemon stores only its hash):\n{token}")
        print(f'token_sha256 = "{digest}"')
        return EXIT_OK

    return run
