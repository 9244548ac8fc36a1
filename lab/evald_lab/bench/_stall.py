"""What the stall benchmarks of both servers share: the arms, the rounds, the summary of plain
requests' gaps between tokens against the ``fast`` arm, the targets, the hogs, the report and
its plot (``engine-adapter bench sglang-stall`` and ``vllm-stall``).

A plain request's gaps start with the wait for its first token, counted from the moment it was
sent: a request kept from admission freezes as surely as one kept from its next token, and a
stream shows nothing before it. Each plain request is also marked as overlapped when it finished
before the round's first evaluated request came back (its spans still pending or spinning all
its life): short plain requests (:data:`OVERLAP_PLAIN_TOKENS`) feel the late spans over their
whole life, where long ones decode most of their tokens after the spans' deadlines."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evald.testing import cpu_hogs as hogs

__all__ = [
    "ARMS",
    "LONGEST_RATIO_TARGET",
    "MEDIAN_RATIO_TARGET",
    "OVERLAP_PLAIN_TOKENS",
    "PLAIN_AFTER_S",
    "PLAIN_TOKENS",
    "ArmTag",
    "Rounds",
    "add_round_arguments",
    "arm_tags",
    "hogs",
    "percentile",
    "print_arms",
    "result_of",
    "run_rounds",
    "summarize",
    "write_report",
]

#: ``fast`` first: every other arm is compared with it. ``apart``: the spinning tenant's spans
#: with result and error openers that share no first character (``[`` / ``{``), so nothing of
#: the region can be forced before the value (the overlap scheduler's step budget).
ARMS = ("fast", "spinning", "stopped", "slow", "apart")
#: The plain requests are sent this long after the evaluated ones, so they arrive while spans
#: are pending, as they do on a server in use.
PLAIN_AFTER_S = 0.5
#: Long enough that the plain streams run through both spans' deadlines (3 s each) and the
#: evaluated requests' returns to the batch.
PLAIN_TOKENS = 160
#: Short enough that a plain request's whole life lies inside the spans' (as an operator met
#: the slowdown: 48 tokens sent half a second after the spans).
OVERLAP_PLAIN_TOKENS = 48


@dataclass(frozen=True)
class ArmTag:
    """What an arm's evaluated requests send: their structural tag and their tenant's token."""

    tag: dict[str, Any]
    token: str


def arm_tags(
    target: str, arms: Sequence[str], tokens: Mapping[str, str], *, stopped: bool
) -> dict[str, ArmTag]:
    """The requests of each arm in ``arms`` (in :data:`ARMS` order): two spans per request.

    ``tokens``: the tenants' tokens by arm (``fast`` and ``stopped`` share calc's tenant;
    ``spinning`` and ``apart`` a tenant whose deadline outlasts the span's, ``slow`` one whose
    400 ms limit ends each call). ``stopped``: whether evald can be stopped (its process is
    known); without it the arm is left out.
    """
    from engine_adapter import list_evaluators
    from engine_adapter.testing import fixed_tag
    from evald_lab.bench._servers import apart, register_spinner

    calc = {s.name: s for s in list_evaluators(target, tokens["fast"])}["calc"].binding()
    found = {"fast": ArmTag(fixed_tag("So ", (calc, "6 * 7"), " and ", (calc, "1 + 1"), "."),
                            tokens["fast"])}  # fmt: skip
    for name in ("spinning", "slow", "apart"):
        if name in arms:
            spin = register_spinner(target, tokens[name]).binding()
            if name == "apart":
                spin = apart(spin)
            tag = fixed_tag("So ", (spin, "x"), " and ", (spin, "y"), ".")
            found[name] = ArmTag(tag, tokens[name])
    if "stopped" in arms and stopped:
        found["stopped"] = found["fast"]
    return {name: found[name] for name in ARMS if name in found}


@dataclass
class Rounds:
    """What the rounds saw, per arm: every gap (s), each round's longest, first-token waits,
    the evaluated requests' texts, and per plain request whether it finished before the
    round's first evaluated request did."""

    gaps: dict[str, list[float]] = field(default_factory=dict)
    longest: dict[str, list[float]] = field(default_factory=dict)
    first_token: dict[str, list[float]] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)
    overlapped: dict[str, list[bool]] = field(default_factory=dict)


def run_rounds(
    evaluate: Mapping[str, Callable[[], str]],
    stream: Callable[[str], list[float]],
    prompts: Sequence[str],
    *,
    rounds: int,
    plain: int,
    evaluated: int,
    plain_after_s: float = PLAIN_AFTER_S,
    daemon_pid: int | None = None,
) -> Rounds:
    """Alternating rounds, arm by arm: ``evaluated`` calls of the arm's ``evaluate`` (one
    evaluated request; its text), then after ``plain_after_s`` ``plain`` calls of ``stream``
    (one plain streamed request; its chunks' arrival times). evald (``daemon_pid``) is stopped
    through the ``stopped`` arm's rounds."""
    seen = Rounds()
    for name in evaluate:
        seen.gaps[name], seen.longest[name] = [], []
        seen.first_token[name], seen.texts[name], seen.overlapped[name] = [], [], []
    cycle = itertools.cycle(prompts)

    def timed(prompt: str) -> list[float]:
        sent = time.monotonic()
        return [sent, *stream(prompt)]

    def finished(call: Callable[[], str]) -> tuple[str, float]:
        text = call()
        return text, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(plain + evaluated) as pool:
        for _ in range(rounds):
            for name, call in evaluate.items():
                with _stopped(daemon_pid if name == "stopped" else None):
                    calls = [pool.submit(finished, call) for _ in range(evaluated)]
                    time.sleep(plain_after_s)
                    streams = [pool.submit(timed, next(cycle)) for _ in range(plain)]
                    round_gaps: list[float] = []
                    ends: list[float] = []
                    for future in streams:
                        times = future.result()
                        seen.first_token[name].append(times[1] - times[0])
                        round_gaps.extend(b - a for a, b in itertools.pairwise(times))
                        ends.append(times[-1])
                    answers = [future.result() for future in calls]
                    seen.texts[name].extend(text for text, _ in answers)
                    first_back = min(back for _, back in answers)
                    seen.overlapped[name].extend(end <= first_back for end in ends)
                seen.gaps[name].extend(round_gaps)
                seen.longest[name].append(max(round_gaps))
    return seen


def result_of(seen: Rounds, deadline_ms: float, **settings: Any) -> dict[str, Any]:
    """A run's result: ``settings`` (rounds, requests, tokens), the summary of every arm, a
    sample text per arm and the raw gaps (for the plot; left out of the JSON report)."""
    return {
        **settings,
        "span_deadline_ms": deadline_ms,
        "arms": summarize(seen.gaps, seen.longest, deadline_ms, seen.first_token),
        "overlapped_share": {
            name: sum(marks) / len(marks) for name, marks in seen.overlapped.items() if marks
        },
        "sample_texts": {name: values[:1] for name, values in seen.texts.items()},
        "gaps_ms": {name: [g * 1e3 for g in values] for name, values in seen.gaps.items()},
    }


def add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags both stall benchmarks take: rounds, requests, tokens, arms, hogs."""
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plain", type=int, default=4)
    parser.add_argument(
        "--plain-tokens",
        nargs="+",
        type=int,
        default=[OVERLAP_PLAIN_TOKENS, PLAIN_TOKENS],
        help="a plain request's tokens, one run per value: 48 lie inside the spans' life, 160 "
        "run past their deadlines",
    )
    parser.add_argument(
        "--plain-after",
        type=float,
        default=PLAIN_AFTER_S,
        help="seconds between the evaluated requests and the plain ones of a round",
    )
    parser.add_argument("--evaluated", type=int, default=4)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument(
        "--hogs",
        nargs="+",
        type=int,
        default=[0, 2],
        help="busy-looping processes beside the servers, one run per value",
    )


@contextlib.contextmanager
def _stopped(pid: int | None) -> Iterator[None]:
    """evald stopped (SIGSTOP, a hung daemon) for the block, when ``pid`` is given."""
    if pid is None:
        yield
        return
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


#: The targets the summary checks (the longest gap is also held to one span deadline).
MEDIAN_RATIO_TARGET = 1.02
LONGEST_RATIO_TARGET = 1.5


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(
    gaps: dict[str, list[float]],
    longest: dict[str, list[float]],
    deadline_ms: float,
    first_token: dict[str, list[float]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per arm (gaps, each round's longest gap and the first-token waits in seconds): median,
    p99 and longest gap in ms; per late arm the ratios to ``fast`` and whether the targets are
    met."""
    summary: dict[str, dict[str, Any]] = {}
    for name, values in gaps.items():
        ms = [g * 1e3 for g in values]
        summary[name] = {
            "median_gap_ms": statistics.median(ms),
            "p99_gap_ms": percentile(ms, 0.99),
            "max_gap_ms": max(ms),
            "longest_gap_per_round_ms": [g * 1e3 for g in longest[name]],
            # A round's longest gap, as a typical round has it: the maximum over all rounds
            # is one event, where a batch's extends or a busy core fall (docs/sglang.md).
            "median_round_longest_ms": statistics.median(longest[name]) * 1e3,
        }
        if first_token and first_token.get(name):
            waits = [w * 1e3 for w in first_token[name]]
            summary[name]["first_token_median_ms"] = statistics.median(waits)
            summary[name]["first_token_max_ms"] = max(waits)
    fast = summary["fast"]
    for name, arm in summary.items():
        if name == "fast":
            continue
        arm["median_ratio"] = arm["median_gap_ms"] / fast["median_gap_ms"]
        arm["p99_ratio"] = arm["p99_gap_ms"] / fast["p99_gap_ms"]
        arm["longest_ratio"] = arm["max_gap_ms"] / fast["max_gap_ms"]
        arm["round_longest_ratio"] = (
            arm["median_round_longest_ms"] / fast["median_round_longest_ms"]
        )
        arm["under_deadline"] = arm["max_gap_ms"] < deadline_ms
        arm["targets_met"] = (
            arm["median_ratio"] <= MEDIAN_RATIO_TARGET
            and arm["longest_ratio"] <= LONGEST_RATIO_TARGET
            and arm["under_deadline"]
        )
    return summary


def print_arms(key: str, arms: dict[str, dict[str, Any]]) -> None:
    """One line per arm."""
    for name, arm in arms.items():
        line = (
            f"{key:22} {name:8}: median {arm['median_gap_ms']:7.1f} ms, p99 "
            f"{arm['p99_gap_ms']:7.1f} ms, longest {arm['max_gap_ms']:7.0f} ms"
        )
        if "first_token_max_ms" in arm:
            line += f", first token <= {arm['first_token_max_ms']:5.0f} ms"
        if name != "fast":
            line += (
                f"; ÷ fast: median {arm['median_ratio']:.3f}, longest "
                f"{arm['longest_ratio']:.2f} (a round's {arm['round_longest_ratio']:.2f})"
                f"{'' if arm['targets_met'] else '  (target missed)'}"
            )
        print(line, flush=True)


def write_report(results: dict[str, dict[str, Any]], path: Path) -> None:
    """``path`` (JSON, without the raw gaps) and its plot beside it (``.png``), for the runs
    so far (a cut-short run keeps its part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {key: {k: v for k, v in r.items() if k != "gaps_ms"} for key, r in results.items()}
    path.write_text(json.dumps(summary, indent=2) + "\n")
    _plot(results, path.with_suffix(".png"))


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Per run, a box of each arm's gaps (log scale), the span deadline as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    columns = min(4, len(results))
    rows = math.ceil(len(results) / columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(3.4 * columns, 3.8 * rows), sharey=True, squeeze=False
    )
    for axis in axes.flat[len(results) :]:
        axis.set_visible(False)
    for axis, (key, result) in zip(axes.flat, results.items(), strict=False):
        names = list(result["gaps_ms"])
        axis.boxplot([result["gaps_ms"][n] for n in names], whis=(1, 99), showfliers=True)
        axis.set_xticks(range(1, len(names) + 1), names, fontsize=8)
        axis.axhline(result["span_deadline_ms"], color="red", linewidth=0.8, linestyle="--")
        axis.set_yscale("log")
        ratios = [f"{n} {a['longest_ratio']:.2f}" for n, a in result["arms"].items() if n != "fast"]
        lines = [", ".join(ratios[i : i + 2]) for i in range(0, len(ratios), 2)]
        axis.set_title("\n".join([key, "longest ÷ fast:", *lines]), fontsize=7)
    for row in axes:
        row[0].set_ylabel("plain request: ms between tokens\n(whiskers p1-p99; red: deadline)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
