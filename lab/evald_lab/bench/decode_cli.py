"""``engine-adapter bench decode``: the decode benchmark's command (see
:mod:`evald_lab.bench.decode`; ``evald bench decode`` runs the same benchmark), and
``engine-adapter bench operands``: what the operands option costs the grammar
(:mod:`evald_lab.bench.operands`).

Registered through the ``engine_adapter.commands`` entry point of ``lab/pyproject.toml``.
Exit statuses: 0 the benchmark ran and wrote its results; 2 bad arguments, or a model or daemon
that did not start, with ``error: message`` on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine_adapter.cli import EXIT_ERROR, EXIT_OK

__all__ = ["add_command"]

#: What ``--parts`` may name, in run order.
_PARTS = ("decode", "toolcall", "stall")


def add_command(sub: Any) -> None:
    """Adds ``bench`` to ``engine-adapter``'s subparsers."""
    bench = sub.add_parser(
        "bench",
        help="Benchmark decoding with spans (also `evald bench decode`).",
        description=(
            "decode: tokens/s and added time per span for no evaluation, in-process Python, "
            "in-process WASM and evald (same prompts, same seeds, interleaved); the tool-call "
            "baseline; the batch stall with one span slow up to its deadline. Starts its own "
            "evald daemon. Writes decode.json and decode.png under --out. The GPU variant is "
            "deploy/gpu-check.sh. operands: grammar compile time and mask fill with the "
            "operands option against without, side by side (operands.json, operands.png)."
        ),
    )
    bench.add_argument("job", choices=("decode", "operands"), help="what to measure")
    bench.add_argument(
        "--profile", choices=("tiny", "full"), default="full", help="tiny: for tests"
    )
    bench.add_argument("--out", type=Path, default=Path("reports/bench"), help="results folder")
    bench.add_argument(
        "--parts", default=",".join(_PARTS), help="comma-separated: " + ",".join(_PARTS)
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    bench.set_defaults(_runner=_bench)


def _bench(args: argparse.Namespace) -> int:
    from engine_adapter.local import BackendError
    from evald_lab.bench.decode import run_decode

    if args.job == "operands":
        from evald_lab.bench.operands import run_operands

        run_operands(
            args.profile, out_dir=args.out, plot=not args.no_plot, show_progress=not args.quiet
        )
        print(f"results in {args.out}/operands.json", file=sys.stderr)
        return EXIT_OK

    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in parts if part not in _PARTS]
    if unknown or not parts:
        print(
            f"error: unknown --parts {unknown}; choose from {', '.join(_PARTS)}", file=sys.stderr
        )
        return EXIT_ERROR
    try:
        run_decode(
            args.profile,
            out_dir=args.out,
            show_progress=not args.quiet,
            plot=not args.no_plot,
            parts=parts,
        )
    except (BackendError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"results in {args.out}/decode.json", file=sys.stderr)
    return EXIT_OK
