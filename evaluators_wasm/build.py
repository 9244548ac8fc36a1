"""Rebuilds the standard evaluators: ``python -m evaluators_wasm.build [NAME ...] [--out DIR]``.

Each ``src/NAME/`` holds ``main.zig``, ``manifest.json`` and ``grammar.ebnf``; the module with its
embedded manifest is written to ``wasm/NAME.wasm``. The build is deterministic, and
``tests/evaluators_wasm/test_build_reproducible.py`` checks the committed bytes against a rebuild.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from evaluators_wasm import SOURCE_DIR, WASM_DIR
from evaluators_wasm.toolchain import build_evaluator


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
