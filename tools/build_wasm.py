"""Rebuilds the standard evaluators: ``make wasm``, or ``python tools/build_wasm.py [NAME ...]
[--out DIR]``; their ports to other languages: ``make ports``, or ``python
tools/build_wasm.py --ports [NAME ...]``; and the example tenant evaluators
(``evaluators_wasm/examples/``): ``make examples``, or ``python tools/build_wasm.py --examples``.

Each ``evaluators_wasm/src/NAME/`` holds ``main.zig``, ``manifest.json`` and ``grammar.ebnf``; the
module with its embedded manifest is written to ``evaluators_wasm/wasm/NAME.wasm``. Each port,
``evaluators_wasm/ports/NAME/`` (Rust or AssemblyScript), is written beside its source as
``NAME.wasm``, where ``evald build`` writes it; the ports need rustc for wasm32 and the
repository's pinned asc (``make toolchains``). The build is the SDK's
(:func:`evald.sdk.build_evaluator`, the one ``evald build`` runs, in its sandbox where bwrap
is installed) and is deterministic:
``tests/evaluators_wasm/test_build_reproducible.py`` rebuilds and compares the bytes with the
committed modules. A repository tool, not part of any wheel: the guest package holds the
sources and the built modules, the SDK the build.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from evald.contract import EvaldError
from evald.sdk import BuildSandbox, build_evaluator, find_bwrap
from evaluators_wasm import (
    EXAMPLES,
    EXAMPLES_DIR,
    PORTS,
    PORTS_DIR,
    SOURCE_DIR,
    WASM_DIR,
    example_path,
    port_path,
)

#: The AssemblyScript compiler ``make toolchains`` installs (package.json and lock beside it).
REPOSITORY_ASC = Path(__file__).resolve().parent / "assemblyscript/node_modules/.bin/asc"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="evaluators to build (default: all of them)")
    parser.add_argument("--out", type=Path, help="output folder (default: where they belong)")
    parser.add_argument("--ports", action="store_true", help="build the ports instead")
    parser.add_argument("--examples", action="store_true", help="build the examples instead")
    args = parser.parse_args(argv)
    if args.examples:
        names = args.names or list(EXAMPLES)
        sources = {name: EXAMPLES_DIR / name for name in names}
        targets = {
            name: args.out / f"{name}.wasm" if args.out else example_path(name) for name in names
        }
    elif args.ports:
        if REPOSITORY_ASC.is_file():
            os.environ.setdefault("EVALD_ASC", str(REPOSITORY_ASC))
        names = args.names or list(PORTS)
        sources = {name: PORTS_DIR / name for name in names}
        targets = {
            name: args.out / f"{name}.wasm" if args.out else port_path(name) for name in names
        }
    else:
        names = args.names or sorted(p.name for p in SOURCE_DIR.iterdir() if p.is_dir())
        sources = {name: SOURCE_DIR / name for name in names}
        targets = {name: (args.out or WASM_DIR) / f"{name}.wasm" for name in names}
    sandbox = _sandbox()
    for name in names:
        wasm = build_evaluator(sources[name], sandbox=sandbox)
        targets[name].parent.mkdir(parents=True, exist_ok=True)
        targets[name].write_bytes(wasm)
        print(f"built {targets[name].name} ({len(wasm)} bytes)")


def _sandbox() -> BuildSandbox:
    """The SDK's sandbox where bwrap works here; these are the repository's own sources, so
    without it they are built unsandboxed (the same bytes), saying so."""
    try:
        find_bwrap()
    except EvaldError as exc:
        print(f"note: building unsandboxed, as the sources are the repository's own: {exc.message}")
        return BuildSandbox(unsandboxed=True)
    return BuildSandbox()


if __name__ == "__main__":
    main()
