"""Does another tenant's late value freeze a plain stream? The tail of plain requests' gaps
between tokens on a real vLLM CPU server, next to evaluated requests whose values are late,
against the same next to fast spans, quiet and beside CPU hogs: the same arms, summary and
targets as ``engine-adapter bench sglang-stall`` (:mod:`evald_lab.bench._stall`).

Each round sends ``--evaluated`` requests whose structural tag holds two spans, then, after
``--plain-after`` seconds (spans are pending by then), ``--plain`` streamed plain requests
(``ignore_eos``, ``--plain-tokens``, long enough to run through both spans' deadlines). A plain
request's gaps start with the wait for its first token, from the moment it was sent. The arms:

- ``fast``: the spans go to calc (a value in microseconds): the reference;
- ``spinning``: to a tenant's evaluator that loops until the 3 s span deadline;
- ``stopped``: calc spans while evald is stopped (SIGSTOP, a hung daemon);
- ``slow``: to a tenant whose evaluator takes 400 ms while evald has only 2 workers.
- ``apart``: the spinning tenant's spans with result and error openers that share no first
  character (``[`` / ``{``): nothing of the region can be forced before the value, so a step
  built before the span closed (the overlap scheduler) has the request in it while the value is
  pending (the step's budget then ends the span in band).

Rounds alternate arm by arm. Per arm the median, p99 and longest gap; per late arm the ratios
to ``fast`` (targets: median <= 1.02, longest <= 1.5) and whether the longest gap stays under
one span deadline. Prints a line per arm, writes ``reports/vllm/stall.json`` and a plot.

    engine-adapter bench vllm-stall [--rounds 5] [--hogs 0 2]

Needs ``.venv-vllm`` (``make vllm-venv``); starts its own evald (in a session of its own, as a
service runs) and vLLM server.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_adapter.testing.vllm import (
    CONFIG,
    DEADLINE_MS,
    SLOW_TOKEN,
    SPIN_TOKEN,
    TOKEN,
    VllmServer,
    start_server,
    tag_body,
    vllm_python,
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
REPORT_DIR = Path("reports") / "vllm"
PLAIN_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Three reasons to learn Python are",
    "Once upon a time, in a small village,",
    "The best way to cook rice is",
]


def measure_stall(
    server: VllmServer,
    target: str,
    *,
    rounds: int = 5,
    plain: int = 4,
    evaluated: int = 4,
    max_tokens: int = PLAIN_TOKENS,
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
        body = tag_body(arm.tag, evald_token=arm.token)

        def call() -> str:
            answer = server.complete("Compute:", max_tokens=120, **body)
            return str(answer["choices"][0]["text"])

        return call

    def stream(prompt: str) -> list[float]:
        _, times = server.stream(prompt, max_tokens=max_tokens, ignore_eos=True)
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
        rounds=rounds,
        plain_requests=plain,
        plain_tokens=max_tokens,
        plain_after_s=plain_after_s,
        evaluated_requests=evaluated,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench vllm-stall``."""
    add_round_arguments(parser)
    parser.add_argument("--out", type=Path, default=REPORT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    python = vllm_python()
    if python is None:
        print(
            "error: unavailable: the vLLM venv is absent: run `make vllm-venv` first",
            file=sys.stderr,
        )
        return 2
    from evald.testing import DaemonProcess, start_daemon

    results: dict[str, dict[str, Any]] = {}
    arms = tuple(dict.fromkeys(["fast", *args.arms]))
    with tempfile.TemporaryDirectory(prefix="evald-vllm-") as tmp:
        root = Path(tmp)
        daemon: DaemonProcess = start_daemon(root / "evald", CONFIG, own_session=True)
        try:
            env = {
                "EVALD_TARGET": daemon.target,
                "EVALD_TOKEN": TOKEN,
                "EVALD_DEADLINE_MS": str(DEADLINE_MS),
            }
            server = start_server(python, env, root / "vllm.log")
            try:
                for count, tokens in itertools.product(args.hogs, args.plain_tokens):
                    with hogs(count):
                        result = measure_stall(
                            server, daemon.target, rounds=args.rounds, plain=args.plain,
                            evaluated=args.evaluated, max_tokens=tokens,
                            plain_after_s=args.plain_after, arms=arms, daemon_pid=daemon.pid,
                        )  # fmt: skip
                    result["hogs"] = count
                    key = f"{'quiet' if not count else f'{count} hogs'}/{tokens} tok"
                    results[key] = result
                    print_arms(key, result["arms"])
                    write_report(results, args.out / "stall.json")
            finally:
                server.stop()
        finally:
            daemon.stop()
    return 0
