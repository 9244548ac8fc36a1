"""``evald bench``: the benchmarks (see :mod:`evald_lab.bench`).

evald's CLI imports this module through the ``evald.commands`` entry point of
``lab/pyproject.toml``; importing it registers the command.

Exit statuses: 0 the benchmark ran and wrote its results (missed targets are reported, not
failures); 2 it could not run (bad arguments, a daemon or the model that did not start).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from evald.cli import EXIT_ERROR, EXIT_OK, Runner, command
from evald_lab.bench._jobs import JobParser, add_job, run_job

__all__: list[str] = []

_EPILOG = """\
Jobs:
  overhead   per-evaluation latency (p50/p99) and throughput of every path: the Python
             reference, in-process WASM (reused and fresh instance), the daemon over its unix
             socket and loopback TCP (unary, batched 1/8/64, streaming 1/8/64), at
             concurrency 1, 8 and 64; each row also as a ratio to the Python row and as a
             fraction of one llama.cpp decode step measured in the same run.
  decode     the local CPU engine (SmolLM2-135M, llama.cpp) generating with spans: tokens/s and
             added time per span for no evaluation, in-process Python, in-process WASM and
             evald; the tool-call baseline; the batch stall. Runs engine-adapter's benchmark
             (the engine and llama extras).
  profile    where the time goes: one host evaluation split into its parts, and the daemon's
             CPU per item by thread under EvaluateBatch(64), plus what holds the GIL (py-spy).
  all        all three, then the headline table (headline.md, headline.json).
  headline   the headline table again from the results already in --out (no measuring).

Measurements of one part each (their own flags: evald bench JOB --help):
  control-plane 3 daemons following one real PostgreSQL: a registration, a revocation and a
                limits change reaching every daemon; the hot path with the store on.
  daemon        fresh beside reuse isolation: every path's round trip and items/s (docs/daemon.md).
  heavy-tenants a victim next to a looping tenant, its workers lowered or not, quiet or busy.
  host          the host's call paths, isolation modes, compile cache and threads.
  registration  other tenants' latency while one registers heavy modules; the upload oracle.
  workers       one daemon process against two, side by side (docs/data-path.md).

Results: JSON and PNG under --out (default reports/bench/). The GPU variant of the decode
benchmark (SGLang, several batch sizes) is deploy/gpu-check.sh.

Examples:
  evald bench overhead --profile tiny          # a few seconds, every path once
  evald bench all                              # the full run, about 10 minutes on 2 cores
  evald bench all --readme README.md           # also refresh the README's headline table
"""


#: The jobs that share the flags below and write the headline table's results.
_HEADLINE_JOBS = {
    "overhead": "per-evaluation latency and throughput of every path",
    "decode": "the local CPU engine generating with spans",
    "profile": "where one evaluation's time goes",
    "all": "overhead, decode and profile, then the headline table",
    "headline": "the headline table again from saved results",
}
#: The measurements of one part each: (job, module, help).
_MEASUREMENTS = (
    ("control-plane", "evald_lab.bench.control_plane", "the fleet store's bounds, 3 daemons"),
    ("daemon", "evald_lab.bench.daemon_calls", "fresh beside reuse, every path of the daemon"),
    ("heavy-tenants", "evald_lab.bench.heavy_tenants", "heavy tenants' workers lowered or not"),
    ("host", "evald_lab.bench.host_paths", "the host's call paths and modes"),
    ("registration", "evald_lab.bench.registration", "registration as a neighbour"),
    ("workers", "evald_lab.bench.workers", "one daemon process against two"),
)


@command("bench", "Benchmark the evaluation paths and decoding with spans.", order=60)
def _bench(parser: argparse.ArgumentParser) -> Runner:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    jobs = parser.add_subparsers(
        dest="job", required=True, metavar="JOB", parser_class=JobParser, help="what to measure"
    )
    for job, help_text in _HEADLINE_JOBS.items():
        _add_headline_flags(jobs.add_parser(job, help=help_text))
    for job, module, help_text in _MEASUREMENTS:
        add_job(jobs, job, module, help_text)

    def run(args: argparse.Namespace) -> int:
        status = run_job(args)
        return _run_headline_job(args) if status is None else status

    return run


def _add_headline_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        choices=("tiny", "full"),
        default="full",
        help="tiny: seconds, for tests; full: the real run (default)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("reports/bench"), metavar="DIR", help="results folder"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plot", action="store_true", help="skip the matplotlib plots")
    parser.add_argument(
        "--no-decode-step",
        action="store_true",
        help="overhead: do not load the model to time a decode step",
    )
    parser.add_argument(
        "--readme",
        type=Path,
        metavar="FILE",
        help="all: replace the headline table between the bench markers in FILE",
    )


def _run_headline_job(args: argparse.Namespace) -> int:
    """The jobs that share the headline flags (their results make the headline table)."""
    if args.readme is not None and args.job not in ("all", "headline"):
        print(
            "error: invalid_argument: --readme needs the `all` or `headline` job",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if args.job == "headline":
        from evald_lab.bench._headline import load_results

        saved = load_results(args.out)
        if saved == (None, None):
            print(f"error: invalid_argument: no results in {args.out}", file=sys.stderr)
            return EXIT_ERROR
        return _headline(args, *saved)
    try:
        overhead: dict[str, Any] | None = None
        decode: dict[str, Any] | None = None
        if args.job in ("overhead", "all"):
            from evald_lab.bench._overhead import run_overhead

            overhead = run_overhead(
                args.profile,
                out_dir=args.out,
                show_progress=not args.no_progress,
                measure_decode_step=not args.no_decode_step,
                plot=not args.no_plot,
            )
        if args.job in ("decode", "all"):
            decode = _run_decode(args)
        if args.job in ("profile", "all"):
            from evald_lab.bench._profile import profile_markdown, run_profile

            profiled = run_profile(args.profile, out_dir=args.out)
            print(profile_markdown(profiled) + "\n")
    except (RuntimeError, OSError, ImportError) as exc:
        print(f"error: unavailable: {' '.join(str(exc).split())[:2000]}", file=sys.stderr)
        return EXIT_ERROR
    if args.job == "profile":
        return EXIT_OK
    return _headline(args, overhead, decode)


def _headline(
    args: argparse.Namespace, overhead: dict[str, Any] | None, decode: dict[str, Any] | None
) -> int:
    """Prints the headline table; for ``all``/``headline`` also writes it (and the README)."""
    from evald_lab.bench._headline import headline_markdown, write_headline

    if args.job in ("all", "headline"):
        try:
            write_headline(args.out, overhead, decode, readme=args.readme)
        except (ValueError, OSError) as exc:
            print(f"error: invalid_argument: {exc}", file=sys.stderr)
            return EXIT_ERROR
    print(headline_markdown(overhead, decode))
    print(f"\nresults in {args.out}/", file=sys.stderr)
    return EXIT_OK


def _run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """``engine_adapter``'s decode benchmark, imported here only (see :mod:`evald_lab.bench`)."""
    try:
        from evald_lab.bench.decode import run_decode
    except ImportError as exc:
        raise ImportError(
            f"the decode benchmark needs the engine adapter's extras ({exc}): "
            "pip install -e '.[engine,llama]' -e './lab[bench]'"
        ) from exc
    document: dict[str, Any] = run_decode(
        args.profile,
        out_dir=args.out,
        show_progress=not args.no_progress,
        plot=not args.no_plot,
    )
    return document
