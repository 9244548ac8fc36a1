"""``engine-adapter study --problems booking``: the booking study's options and command.

``--arms`` picks arms (default all four), ``--cases`` message ids (default all), ``--seeds``
sampled runs besides greedy decoding; ``--out`` defaults to ``reports/study/booking/MODEL``.
``--summarize-only`` re-scores the saved records without a model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from evald_lab.study.booking.arms import ARMS

__all__ = ["add_booking_options", "booking_out_dir", "run_booking_command"]

_EXIT_OK, _EXIT_ERROR = 0, 2


def add_booking_options(study: argparse.ArgumentParser) -> None:
    """The options only ``--problems booking`` reads."""
    group = study.add_argument_group("booking study (--problems booking)")
    group.add_argument(
        "--arms",
        default=",".join(ARMS),
        metavar="LIST",
        help=f"comma-separated arms (default: all: {', '.join(ARMS)})",
    )
    group.add_argument(
        "--cases", default="", metavar="IDS", help="comma-separated message ids (default: all)"
    )
    group.add_argument(
        "--seeds",
        default="greedy",
        metavar="LIST",
        help="comma-separated: greedy and/or integer seeds of sampled runs at "
        "--booking-temperature (default: greedy)",
    )
    group.add_argument(
        "--booking-temperature", type=float, default=0.7, help="temperature of sampled runs"
    )
    group.add_argument(
        "--policy",
        choices=("wasm", "python"),
        default="wasm",
        help="what computes the decision in the computed arms: wasm (default: the SDK's "
        "example policy in the WASM host) or python (the study's code as an evaluator)",
    )


def booking_out_dir(args: argparse.Namespace) -> Path:
    """``--out``, or ``reports/study/booking/MODEL``."""
    out: Path | None = args.out
    return out if out is not None else Path("reports/study/booking") / args.model


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return _EXIT_ERROR


def _config(args: argparse.Namespace) -> Any:
    """The :class:`BookingConfig` of the arguments (``ValueError`` on bad ones)."""
    from evald_lab.study.booking.runner import BookingConfig

    names = [name.strip() for name in args.arms.split(",") if name.strip()]
    try:
        cases = tuple(int(c) for c in args.cases.split(",") if c.strip())
        seeds = tuple(
            None if s.strip() == "greedy" else int(s) for s in args.seeds.split(",") if s.strip()
        )
    except ValueError:
        raise ValueError("--cases takes ids and --seeds greedy or integers") from None
    return BookingConfig(
        model=args.model,
        arms=tuple(names),
        cases=cases,
        seeds=seeds,
        temperature=args.booking_temperature,
        out_dir=booking_out_dir(args),
        plot=not args.no_plot,
        progress=not args.quiet,
        resume=args.resume,
    )


def run_booking_command(args: argparse.Namespace) -> int:
    """Runs (or re-summarizes) the booking study; prints the table."""
    from engine_adapter.cli import open_engine
    from engine_adapter.local import BackendError, EngineError
    from evald_lab.study.booking.generation import LocalJsonGenerator
    from evald_lab.study.booking.policy import WasmPolicy
    from evald_lab.study.booking.report import resummarize
    from evald_lab.study.booking.runner import plug_policy, run_booking

    if args.summarize_only:
        try:
            summary = resummarize(booking_out_dir(args), plot=not args.no_plot)
        except FileNotFoundError as exc:
            return _fail(f"no booking records to summarize: {exc}")
        print(summary.table_markdown())
        return _EXIT_OK
    try:
        config = _config(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        engine, setup = open_engine(args)
    except (EngineError, BackendError, FileNotFoundError) as exc:
        return _fail(str(exc))
    try:
        policy = plug_policy(engine, args.policy)
        summary = run_booking(
            LocalJsonGenerator(engine), config, policy_evaluator=policy, meta=_meta(args, engine)
        )
    except (EngineError, ValueError) as exc:
        return _fail(str(exc))
    finally:
        if isinstance(engine.evaluator, WasmPolicy):
            engine.evaluator.close()
        setup.close()
        engine.close()
    print(summary.table_markdown())
    print(f"\nrecords, table and plot in {config.out_dir}", file=sys.stderr)
    return _EXIT_OK


def _meta(args: argparse.Namespace, engine: Any) -> dict[str, Any]:
    from engine_adapter.local import MODEL_NAMES, model_title

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "model_title": model_title(args.model) if args.model in MODEL_NAMES else "",
        "evaluator_mode": args.evaluator_mode,
        "threads": list(getattr(engine.backend, "threads", ()) or ()),
        "load_average_at_start": load,
        "cpus": os.cpu_count(),
        "decoding": "greedy" if args.seeds == "greedy" else f"seeds {args.seeds}",
    }
