"""``engine-adapter bench``: the adapter's benchmarks — decoding with spans (``decode``, see
:mod:`evald_lab.bench.decode`; ``evald bench decode`` runs the same benchmark), the grammar's
mask fill (``mask-fill``), what the operands option costs it (``operands``), and the adapters
inside real SGLang and vLLM servers (``sglang-*``, ``vllm-*``; they need ``make sglang-venv`` /
``make vllm-venv`` and run from the checkout).

Registered through the ``engine_adapter.commands`` entry point of ``lab/pyproject.toml``.
Exit statuses: 0 the benchmark ran and wrote its results; 2 bad arguments, or a model, daemon
or server that did not start, with ``error: message`` on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine_adapter.cli import EXIT_ERROR, EXIT_OK
from evald_lab.bench._jobs import JobParser, add_job, run_job

__all__ = ["add_command"]

#: What ``--parts`` may name, in run order.
_PARTS = ("decode", "toolcall", "stall")
#: The measurements with a module of their own: (job, module, help).
_MEASUREMENTS = (
    ("mask-fill", "evald_lab.bench.mask_fill", "the span grammar's bitmask fill per position"),
    ("operands", "evald_lab.bench.operands", "the operands option: compile and mask fill, vs off"),
    ("sglang-jump", "evald_lab.bench.sglang_jump", "SGLang: forwards and time per result"),
    ("sglang-stall", "evald_lab.bench.sglang_stall", "SGLang: plain requests next to a slow span"),
    ("sglang-cost", "evald_lab.bench.sglang_cost", "SGLang: the plugin loaded vs not; data path"),
    ("sglang-overhead", "evald_lab.bench.sglang_overhead", "SGLang: the adapter's cost per token"),
    ("vllm-forwards", "evald_lab.bench.vllm_forwards", "vLLM: forwards and time per result"),
    ("vllm-stall", "evald_lab.bench.vllm_stall", "vLLM: plain requests next to a slow span"),
    ("vllm-overhead", "evald_lab.bench.vllm_overhead", "vLLM: the adapter's cost per row and step"),
    ("vs-tools", "evald_lab.bench.vs_tools", "SGLang and vLLM: evaluated spans vs tool calling"),
)


def add_command(sub: Any) -> None:
    """Adds ``bench`` to ``engine-adapter``'s subparsers."""
    bench = sub.add_parser(
        "bench",
        help="Benchmark decoding with spans, the grammar, the adapters in SGLang and vLLM.",
        description="The adapter's benchmarks; each job's flags: engine-adapter bench JOB --help.",
    )
    jobs = bench.add_subparsers(
        dest="job", required=True, metavar="JOB", parser_class=JobParser, help="what to measure"
    )
    decode = jobs.add_parser(
        "decode",
        help="decoding with spans (also `evald bench decode`)",
        description=(
            "decode: tokens/s and added time per span for no evaluation, in-process Python, "
            "in-process WASM and evald (same prompts, same seeds, interleaved); the tool-call "
            "baseline; the batch stall with one span slow up to its deadline. Starts its own "
            "evald daemon. Writes decode.json and decode.png under --out. The GPU variant is "
            "deploy/gpu-check.sh."
        ),
    )
    for job, module, help_text in _MEASUREMENTS:
        add_job(jobs, job, module, help_text)
    bench.set_defaults(_runner=_bench)
    decode.add_argument(
        "--profile", choices=("tiny", "full"), default="full", help="tiny: for tests"
    )
    decode.add_argument("--out", type=Path, default=Path("reports/bench"), help="results folder")
    decode.add_argument(
        "--parts", default=",".join(_PARTS), help="comma-separated: " + ",".join(_PARTS)
    )
    decode.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    decode.add_argument("--quiet", action="store_true", help="no progress bars")


def _bench(args: argparse.Namespace) -> int:
    status = run_job(args)
    if status is not None:
        return status
    from engine_adapter.local import BackendError
    from evald_lab.bench.decode import run_decode

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
