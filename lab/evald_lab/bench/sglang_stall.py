"""Does another tenant's late value freeze a plain stream? The tail of plain requests' gaps
between tokens on a real SGLang CPU server, next to evaluated requests of another tenant whose
values are late, against the same next to fast spans — for both of SGLang's schedulers, quiet and
beside CPU hogs.

Each round sends ``--evaluated`` requests whose structural tag holds two spans, then, after
``--plain-after`` seconds (spans are pending by then), ``--plain`` streamed plain requests (a
third tenant's, ``ignore_eos``, ``--plain-tokens``, one run per value: 48, whose whole life lies
inside the spans', as an operator feels a spinning tenant, and 160, long enough to run through
both spans' deadlines and the evaluated requests' jumps). A plain request's gaps start with the
wait for its first token, from the moment it was sent. The arms:

- ``fast``: the spans go to calc (a value in microseconds): the reference;
- ``spinning``: to a tenant's evaluator that loops until the 3 s span deadline
  (``deadline_exceeded``), burning one of evald's workers all that time;
- ``stopped``: calc spans while evald is stopped (SIGSTOP, a hung daemon): every span waits for
  its deadline;
- ``slow``: to a tenant whose evaluator takes 400 ms while evald has only 2 workers (the
  evaluated requests' spans queue behind each other).
- ``apart``: the spinning tenant's spans with result and error openers that share no first
  character (``[`` / ``{``): nothing of the region can be forced before the value, so a step
  built before the span closed (the overlap scheduler) has the request in it while the value is
  pending (the step's budget then ends the span in band).

Rounds alternate arm by arm, so all see the same machine. Per arm: the median, p99 and longest
gap; per late arm against ``fast``: the ratio of medians (target <= 1.02) and of longest gaps
(target <= 1.5), and whether the longest gap stays under one span deadline. ``--hogs 0 2`` runs
everything quiet and again beside two busy-looping processes (a user's server is rarely quiet).
Prints a line per arm, writes ``reports/sglang/stall.json`` and a plot.

``--isolation none`` (the default) shares the machine's cores among SGLang, evald and the hogs,
as an operator runs them; ``--isolation partitioned`` splits them as docs/operations.md says
(:class:`~engine_adapter.testing.CpuPartition`: on 2 cores SGLang under ``taskset`` on CPU 0
with its OpenMP threads bound there, evald with ``[server] cpus = "1"``); both values run both,
one after the other. The hogs are not pinned, in either: an operator's other jobs are not
confined with the engine or evald unless their own service says so, so the kernel spreads them
over every core, the engine's included (with two hogs on two cores, one beside each).

    engine-adapter bench sglang-stall [--rounds 5] [--hogs 0 2] [--isolation none partitioned]
                                      [--tp-size 1 2]

``--tp-size 2`` runs the servers with two tensor-parallel ranks, each rank's OpenMP threads on
its own share of the cores (``engine_adapter.testing.rank_cpu_lists``; with the cores shared
with evald and the hogs, jump scheduling).

Needs ``.venv-sglang`` (``make sglang-venv``); starts its own evald (in a session of its own, as
a service runs: its own scheduling group, docs/design.md) and SGLang servers.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_adapter.testing import PLAIN_PROMPTS as ALL_PLAIN_PROMPTS
from engine_adapter.testing import CpuPartition
from engine_adapter.testing.sglang import (
    CONFIG,
    DEADLINE_MS,
    OTHER_TOKEN,
    SCHEDULERS,
    SLOW_TOKEN,
    SPIN_TOKEN,
    TOKEN,
    SglangServer,
    sglang_python,
    start_server,
)
from evald_lab.bench._stall import (
    ARMS,
    PLAIN_AFTER_S,
    PLAIN_TOKENS,
    ArmTag,
    add_round_arguments,
    arm_tags,
    hogs,
    print_arms,
    result_of,
    run_rounds,
    write_report,
)

#: Relative to the checkout the command runs in, like every benchmark\'s results.
REPORT_DIR = Path("reports") / "sglang"
MODES = ("inline", "jump")
ISOLATIONS = ("none", "partitioned")
PLAIN_PROMPTS = ALL_PLAIN_PROMPTS[:6]


def measure_stall(
    server: SglangServer,
    target: str,
    *,
    rounds: int = 5,
    plain: int = 4,
    evaluated: int = 4,
    max_tokens: int = PLAIN_TOKENS,
    evaluated_tokens: int = 80,
    plain_after_s: float = PLAIN_AFTER_S,
    arms: tuple[str, ...] = ARMS,
    daemon_pid: int | None = None,
) -> dict[str, Any]:
    """Runs the alternating rounds on ``server`` (whose adapter uses evald at ``target``).

    ``daemon_pid``: evald's process, stopped for the ``stopped`` arm's rounds (the arm is
    skipped without it).
    """
    tags = arm_tags(
        target,
        arms,
        {"fast": TOKEN, "spinning": SPIN_TOKEN, "slow": SLOW_TOKEN, "apart": SPIN_TOKEN},
        stopped=daemon_pid is not None,
    )

    def evaluate(arm: ArmTag) -> Callable[[], str]:
        def call() -> str:
            answer = server.generate(
                "Compute:",
                max_new_tokens=evaluated_tokens,
                structural_tag=arm.tag,
                custom_params={"evald_token": arm.token},
            )
            return str(answer["text"])

        return call

    def stream(prompt: str) -> list[float]:
        _, times = server.stream(
            prompt,
            max_new_tokens=max_tokens,
            ignore_eos=True,
            custom_params={"evald_token": OTHER_TOKEN},
        )
        return times

    seen = run_rounds(
        {name: evaluate(arm) for name, arm in tags.items()},
        stream,
        PLAIN_PROMPTS,
        rounds=rounds,
        plain=plain,
        evaluated=evaluated,
        plain_after_s=plain_after_s,
        daemon_pid=daemon_pid,
    )
    return result_of(
        seen,
        DEADLINE_MS,
        scheduler=server.scheduler,
        rounds=rounds,
        plain_requests=plain,
        plain_tokens=max_tokens,
        plain_after_s=plain_after_s,
        evaluated_requests=evaluated,
        evaluated_tokens=evaluated_tokens,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench sglang-stall``."""
    add_round_arguments(parser)
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--modes", nargs="+", default=["jump"], choices=MODES)
    parser.add_argument(
        "--isolation", nargs="+", choices=ISOLATIONS, default=["none"],
        help="none: every core shared; partitioned: the engine's cores and evald's apart",
    )  # fmt: skip
    parser.add_argument(
        "--tp-size", nargs="+", type=int, default=[1],
        help="SGLang's --tp-size, each rank on its own share of the cores (isolation none, "
        "jump scheduling only): 1 2 runs both",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPORT_DIR)
    parser.add_argument("--report", default="stall.json", help="the report's file name in --out")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    python = sglang_python()
    if python is None:
        print(
            "error: unavailable: the SGLang venv is absent: run `make sglang-venv` first",
            file=sys.stderr,
        )
        return 2
    results: dict[str, dict[str, Any]] = {}
    report = args.out / args.report
    with tempfile.TemporaryDirectory(prefix="evald-sgl-") as tmp:
        for isolation in args.isolation:
            partition = CpuPartition.split() if isolation == "partitioned" else None
            _run_isolation(python, Path(tmp) / isolation, partition, args, results, report)
    write_report(results, report)
    return 0


def _run_isolation(
    python: Path,
    root: Path,
    partition: CpuPartition | None,
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    report: Path,
) -> None:
    """Every scheduler, mode, hog count and plain length on one evald, with the CPUs shared
    (``partition`` None) or split; adds each run to ``results`` and rewrites the report."""
    from evald.testing import DaemonProcess, start_daemon

    isolation = "partitioned" if partition else "none"
    config = partition.daemon_config(CONFIG) if partition else CONFIG
    arms = tuple(dict.fromkeys(["fast", *args.arms]))
    daemon: DaemonProcess = start_daemon(root / "evald", config, own_session=True)
    try:
        for scheduler, mode, tp in itertools.product(args.schedulers, args.modes, args.tp_size):
            if tp > 1 and (partition is not None or mode == "inline"):
                continue  # one rank per partition; inline scheduling is refused with TP
            env = {
                "EVALD_TARGET": daemon.target,
                "EVALD_TOKEN": TOKEN,
                "EVALD_DEADLINE_MS": str(DEADLINE_MS),
                "EVALD_SGLANG_SCHEDULING": mode,
            }
            name = scheduler if tp == 1 else f"{scheduler}-tp{tp}"
            log = root / f"sglang-{name}-{mode}.log"
            server = start_server(
                python, env, log, scheduler=scheduler, partition=partition, tp_size=tp
            )
            try:
                for count, tokens in itertools.product(args.hogs, args.plain_tokens):
                    with hogs(count):
                        result = measure_stall(
                            server, daemon.target, rounds=args.rounds, plain=args.plain,
                            max_tokens=tokens, plain_after_s=args.plain_after,
                            evaluated=args.evaluated, arms=arms, daemon_pid=daemon.pid,
                        )  # fmt: skip
                    result.update(mode=mode, isolation=isolation, hogs=count, tp_size=tp)
                    if partition is not None:
                        result.update(engine_cpus=partition.engine, evald_cpus=partition.evald)
                    hogged = "quiet" if not count else f"{count} hogs"
                    key = f"{isolation}/{name}/{mode}/{hogged}/{tokens} tok"
                    results[key] = result
                    print_arms(key, result["arms"])
                    write_report(results, report)  # a cut-short run keeps its part
            finally:
                server.stop()
    finally:
        daemon.stop()
