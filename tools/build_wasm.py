"""Rebuilds the standard evaluators: ``make wasm``, or ``python tools/build_wasm.py [NAME ...]
[--out DIR]``.

Each ``evaluators_wasm/src/NAME/`` holds ``main.zig``, ``manifest.json`` and ``grammar.ebnf``; the
module with its embedded manifest is written to ``evaluators_wasm/wasm/NAME.wasm``. The build is
the SDK's (:func:`evald.sdk.build_evaluator`, the one ``evald build`` runs) and is deterministic:
``tests/evaluators_wasm/test_build_reproducible.py`` runs this script and compares the bytes with
the committed modules. A repository tool, not part of any wheel: the guest package holds the
sources and the built modules, the SDK the build.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evald.sdk import build_evaluator
from evaluators_wasm import SOURCE_DIR, WASM_DIR


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="evaluators to build (default: every src/*)")
    parser.add_argument("--out", type=Path, default=WASM_DIR, help="output folder")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.name for p in SOURCE_DIR.iterdir() if p.is_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        wasm = build_evaluator(SOURCE_DIR / name)
        (args.out / f"{name}.wasm").write_bytes(wasm)
        print(f"built {name}.wasm ({len(wasm)} bytes)")


if __name__ == "__main__":
    main()
