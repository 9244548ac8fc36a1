"""``evald fuzz``: the security fuzzer (see :mod:`evald_lab.fuzz`).

evald's CLI imports this module through the ``evald.commands`` entry point of
``lab/pyproject.toml``; importing it registers the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from evald.cli import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, Runner, command

__all__: list[str] = []

_HELP = "Fuzz a real daemon: attack inputs, malicious modules, protocol abuse, faults."
_EPILOG = """\
By default evald fuzz starts its own daemon on a private unix socket, with two tenants (a victim
and an attacker), and drives it with: an attack corpus per standard evaluator, grammar-aware
generated and mutated inputs, malicious WAT modules, and protocol abuse. Along the way it checks
that the daemon never crashes or hangs, that every request gets a value or a typed error within
its deadline plus the margin, that limits hold (fuel, time, memory, output, input), that RSS stays
under the bound, and that no response carries the other tenant's data. It measures the victim's
latency alone and while the attacker burns its whole budget on every call, kills the daemon with
SIGKILL under load and restarts it, and fills the module store's disk.

Exit status: 0 when no invariant was broken, 2 when one was (the report lists them), 1 when the
daemon could not be started or reached.

Examples:
  evald fuzz --profile short                       # about a minute
  evald fuzz --profile full --out reports/fuzz/    # 1,000,000 inputs
  evald fuzz --seconds 600 --seed 7
  evald fuzz --target unix:/run/evald/evald.sock --target-config /etc/evald/evald.toml \\
      --victim team-a --attacker team-b   # tokens from $EVALD_FUZZ_VICTIM_TOKEN / _ATTACKER_TOKEN
"""


@command("fuzz", _HELP, order=50)
def _fuzz(parser: argparse.ArgumentParser) -> Runner:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.add_argument(
        "--profile",
        choices=("short", "full"),
        default="short",
        help="short: the make-test run (~1 min); full: 1,000,000 inputs (default short)",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--count", type=int, metavar="N", help="input budget of the main loop")
    budget.add_argument("--seconds", type=float, metavar="S", help="time budget of the main loop")
    parser.add_argument("--seed", type=int, default=0, help="inputs depend only on it (default 0)")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write PROFILE.json, PROFILE.md and PROFILE.png there (e.g. reports/fuzz/)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="worker threads of the daemon it starts (default 2)"
    )
    parser.add_argument(
        "--margin-ms",
        type=float,
        default=250.0,
        help="slack on every deadline check, for a busy machine (default 250)",
    )
    parser.add_argument(
        "--rss-bound-mib", type=int, default=1024, help="daemon RSS bound (default 1024)"
    )
    parser.add_argument(
        "--noisy-attackers",
        type=int,
        default=0,
        help="attacker threads in the noisy-neighbour run (default: the daemon's threads)",
    )
    parser.add_argument("--no-faults", action="store_true", help="skip kill -9 and the full disk")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--keep", action="store_true", help="keep the daemon's folder (logs)")
    target = parser.add_argument_group("an existing daemon (instead of starting one)")
    target.add_argument("--target", metavar="ADDR", help="unix:PATH or HOST:PORT")
    target.add_argument("--target-config", type=Path, metavar="FILE", help="its config (limits)")
    target.add_argument("--target-pid", type=int, metavar="PID", help="its pid (for RSS)")
    target.add_argument("--victim", default="victim", help="victim tenant name")
    target.add_argument("--attacker", default="attacker", help="attacker tenant name")

    def run(args: argparse.Namespace) -> int:
        from rich.console import Console

        from evald_lab.fuzz import PROFILES, FuzzSettings, run_fuzz, summary_markdown, write_report

        console = Console(stderr=True)
        if args.target and not args.target_config:
            print("error: invalid_argument: --target needs --target-config", file=sys.stderr)
            return EXIT_ERROR
        settings = FuzzSettings(
            profile=PROFILES[args.profile],
            count=args.count,
            seconds=args.seconds,
            seed=args.seed,
            out_dir=args.out,
            target=args.target,
            target_config=args.target_config,
            victim=args.victim,
            attacker=args.attacker,
            victim_token=os.environ.get("EVALD_FUZZ_VICTIM_TOKEN", ""),
            attacker_token=os.environ.get("EVALD_FUZZ_ATTACKER_TOKEN", ""),
            target_pid=args.target_pid,
            threads=args.threads,
            margin_ms=args.margin_ms,
            rss_bound_bytes=args.rss_bound_mib * 2**20,
            faults=not args.no_faults,
            progress=not args.no_progress,
            noisy_attackers=args.noisy_attackers,
            extra={"keep": "1"} if args.keep else {},
        )
        try:
            report = run_fuzz(settings, console=console)
        except (RuntimeError, ValueError, OSError) as error:
            print(f"error: unavailable: {error}", file=sys.stderr)
            return EXIT_UNREACHABLE
        print(summary_markdown(report))
        if args.out:
            for path in write_report(report, args.out):
                console.print(f"wrote {path}")
        return EXIT_OK if report["totals"]["violations"] == 0 else EXIT_ERROR

    return run
