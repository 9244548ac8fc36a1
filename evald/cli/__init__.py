"""The ``evald`` command line: one subcommand per user job.

Subcommands register themselves, so each job lives in its own module: every private module of
this package (``evald/cli/_<job>.py``), and every module that an installed distribution names in
the ``evald.commands`` entry-point group (the ``evald-lab`` package's ``fuzz`` and ``bench``), is
imported at start-up and declares its commands with :func:`command`::

    from evald.cli import Runner, command

    @command("fuzz", "Fuzz an evaluator against its reference.", order=50)
    def _fuzz(parser: argparse.ArgumentParser) -> Runner:
        parser.add_argument("name")
        return lambda args: run_fuzz(args.name)   # returns the exit status

Keep those modules' top-level imports light (import heavy libraries inside the runner): every
``evald`` invocation imports all of them.

Exit statuses shared by the client commands: 0 success; 2 the daemon answered with an error
(printed as ``error: CODE: message`` on stderr) or the command line was wrong; 1 the daemon
could not be reached.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "Command",
    "Runner",
    "add_client_options",
    "command",
    "commands",
    "lab_command_hint",
    "main",
]

EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_ERROR = 2

Runner = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], Runner]


@dataclass(frozen=True)
class Command:
    """A registered subcommand: ``configure`` adds its arguments and returns its runner."""

    name: str
    help: str
    configure: Configure
    order: int


_COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, *, order: int = 100) -> Callable[[Configure], Configure]:
    """Registers a subcommand. ``order`` sorts ``evald --help`` (lower first).

    Raises:
        ValueError: another module already registered ``name``.
    """

    def register(configure: Configure) -> Configure:
        existing = _COMMANDS.get(name)
        if existing is not None and existing.configure is not configure:
            raise ValueError(f"evald subcommand {name!r} is registered twice")
        _COMMANDS[name] = Command(name=name, help=help, configure=configure, order=order)
        return configure

    return register


def commands() -> list[Command]:
    """Every registered subcommand (after discovery), in help order."""
    _discover()
    return sorted(_COMMANDS.values(), key=lambda cmd: (cmd.order, cmd.name))


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") and info.name != "__main__":
            importlib.import_module(f"{__name__}.{info.name}")
    _discover_plugins()


#: Subcommands that come with the ``evald-lab`` distribution, for the hint when it is missing.
_LAB_COMMANDS = ("fuzz", "bench")
#: How to get the lab's commands (``evald`` and ``engine-adapter`` both print it).
_LAB_INSTALL = "pip install -e ./lab (from an evald checkout; `make setup` does it)"
#: Entry points of the ``evald.commands`` group that failed to import, with the reason.
_PLUGIN_ERRORS: dict[str, str] = {}


def _discover_plugins() -> None:
    """Imports each module named in the ``evald.commands`` entry-point group; importing it
    registers its commands. One that fails to import is skipped (and named by the hint for a
    missing lab command), so a broken plugin never takes the product's own commands down."""
    for entry in importlib.metadata.entry_points(group="evald.commands"):
        try:
            entry.load()
        except ImportError as exc:
            _PLUGIN_ERRORS[entry.name] = f"{entry.value}: {exc}"


def lab_command_hint(
    prog: str,
    argv: Sequence[str],
    lab_commands: Collection[str],
    available: Collection[str],
    load_errors: Mapping[str, str],
) -> str | None:
    """The message for a command line that asks for one of ``lab_commands`` when it is not
    ``available`` (the ``evald-lab`` package is absent, or named in ``load_errors`` because it
    did not load); None otherwise. Both ``evald`` and ``engine-adapter`` use it."""
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    if name is None or name not in lab_commands or name in available:
        return None
    message = f"`{prog} {name}` comes with the evald-lab package: {_LAB_INSTALL}"
    if name in load_errors:
        message += f"\n(it is installed but did not load: {load_errors[name]})"
    return message


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """``--target``, ``--token``, ``--timeout`` and the TLS files, for commands that dial."""
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--target",
        metavar="ADDR",
        help="unix:PATH or HOST:PORT (default: $EVALD_TARGET, else "
        "unix:$XDG_RUNTIME_DIR/evald.sock, else unix:/tmp/evald-$UID.sock)",
    )
    group.add_argument(
        "--token",
        metavar="TOKEN",
        help="bearer token (default: $EVALD_TOKEN; none needed on the unix socket for the "
        "local tenant)",
    )
    group.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="seconds to wait (default 10)"
    )
    group.add_argument("--tls-ca", metavar="PEM", help="CA certificate of a TLS daemon")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    group.add_argument("--tls-key", metavar="PEM", help="client key (mutual TLS)")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every discovered subcommand."""
    parser = argparse.ArgumentParser(
        prog="evald",
        description="Sandboxed WebAssembly evaluators behind a gRPC daemon.",
        epilog="Run `evald COMMAND --help` for a command's options.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in commands():
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        sub.set_defaults(_runner=cmd.configure(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``evald`` console script; returns the exit status."""
    parser = build_parser()
    hint = lab_command_hint(
        "evald", sys.argv[1:] if argv is None else argv, _LAB_COMMANDS, _COMMANDS, _PLUGIN_ERRORS
    )
    if hint is not None:
        print(f"error: {hint}", file=sys.stderr)
        return EXIT_ERROR
    args = parser.parse_args(argv)
    runner: Runner | None = getattr(args, "_runner", None)
    if runner is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return runner(args)
    except KeyboardInterrupt:
        return 130
