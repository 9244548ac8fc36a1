"""``engine-adapter study``: the accuracy study's command (see :mod:`evald_lab.study.run`).

Registered through the ``engine_adapter.commands`` entry point of ``lab/pyproject.toml``.
Exit statuses: 0 the study ran (or was re-summarized); 2 bad arguments, or a model or daemon
that did not start, with ``error: message`` on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine_adapter.cli import EXIT_ERROR, EXIT_OK, add_engine_options, open_engine
from evald_lab.study.booking.cli import add_booking_options, run_booking_command
from evald_lab.study.run import (
    MODES,
    PROBLEM_SETS,
    PROFILES,
    StudyConfig,
    resummarize,
    run_study,
)

__all__ = ["add_command"]


def add_command(sub: Any) -> None:
    """Adds ``study`` to ``engine-adapter``'s subparsers."""
    study = sub.add_parser(
        "study",
        help="Run the accuracy study (four arms on arithmetic and letter counting), or the "
        "booking-policy study (--problems booking).",
        description=(
            "The accuracy study: no-grammar, grammar-no-eval, grammar-eval and "
            "grammar-eval+operands (the span's literals from the question) on seeded "
            "arithmetic word problems and letter-counting questions over real words, greedy "
            "decoding. Writes per-item JSONL records, a table with 95%% Wilson intervals, "
            "failure causes and paired McNemar tests, and a plot under --out. "
            "--problems booking runs the booking-policy study instead: hand-written customer "
            "messages through four structured-output arms (schema-only, computed, "
            "computed+literals, two-calls), see docs/computed-fields.md."
        ),
    )
    add_engine_options(study, default_evaluator_mode="inprocess")
    study.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default="full",
        help="tiny: 3 items per task (tests); small: 20; full: 200 (default)",
    )
    study.add_argument("--items", type=int, default=None, metavar="N", help="items per task")
    study.add_argument("--seed", type=int, default=20240601, help="seed of the question sampler")
    study.add_argument(
        "--tasks", default="arithmetic,letters", help="comma-separated: arithmetic, letters"
    )
    study.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated arms (default: all four)"
    )
    study.add_argument(
        "--problems",
        choices=(*PROBLEM_SETS, "booking"),
        default="original",
        help="original: the first problem set; heldout: new wordings and sentence orders, "
        "numbers in words in some, distractors in some; booking: the booking-policy study "
        "(its own options below)",
    )
    study.add_argument(
        "--instructions",
        default="off,on",
        metavar="LIST",
        help="comma-separated: off (no instructions), on (rendered from the manifests); "
        "default both",
    )
    study.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: reports/study, or reports/study/booking/MODEL)",
    )
    study.add_argument(
        "--free-max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="token budget of a no-grammar answer (default: the study's FREE_MAX_NEW_TOKENS)",
    )
    study.add_argument(
        "--resume",
        action="store_true",
        help="keep the records an interrupted run left in --out and run only the rest",
    )
    study.add_argument(
        "--summarize-only",
        action="store_true",
        help="load no model: re-score the records in --out, keep the items that ran in every "
        "condition, and rewrite the table, summary and plot",
    )
    study.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    study.add_argument("--quiet", action="store_true", help="no progress bar")
    add_booking_options(study)
    study.set_defaults(_runner=_study)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def _study(args: argparse.Namespace) -> int:
    if args.problems == "booking":
        return run_booking_command(args)
    if args.out is None:
        args.out = Path("reports/study")
    if args.summarize_only:
        try:
            summary = resummarize(args.out, plot=not args.no_plot)
        except FileNotFoundError as exc:
            return _fail(f"no study records to summarize: {exc}")
        print(summary.table_markdown())
        return EXIT_OK

    items = args.items if args.items is not None else PROFILES[args.profile]
    tasks = _names(args.tasks)
    modes = _names(args.modes)
    flags = _names(args.instructions)
    if any(flag not in ("off", "on") for flag in flags):
        return _fail(f"--instructions takes off, on or off,on, not {args.instructions!r}")
    try:
        config = StudyConfig(
            items_per_task=items,
            seed=args.seed,
            tasks=tuple(tasks),
            modes=tuple(modes),
            instructions=tuple(flag == "on" for flag in flags),
            model=args.model,
            problems=args.problems,
            out_dir=args.out,
            plot=not args.no_plot,
            **(
                {"free_max_new_tokens": args.free_max_new_tokens}
                if args.free_max_new_tokens is not None
                else {}
            ),
            resume=args.resume,
            progress=not args.quiet,
        )
    except ValueError as exc:
        return _fail(str(exc))
    from engine_adapter.local import BackendError, EngineError

    try:
        engine, setup = open_engine(args)
    except (EngineError, BackendError, FileNotFoundError) as exc:
        return _fail(str(exc))
    try:
        summary = run_study(engine, config, evaluator_mode=args.evaluator_mode)
    except (EngineError, ValueError) as exc:
        return _fail(str(exc))
    finally:
        setup.close()
        engine.close()
    print(summary.table_markdown())
    print(f"\nrecords, table and plot in {config.out_dir}", file=sys.stderr)
    return EXIT_OK
