"""Does a pending span hold back the batch? Other requests' inter-token latency on a real vLLM
CPU server while evaluated requests wait for an evaluator that spins to its deadline, divided by
the same while their evaluator answers at once.

Each round runs ``--plain`` streamed plain requests next to ``--evaluated`` requests whose
structural tag holds two spans: ``spinning`` rounds send them to a tenant's evaluator that loops
until the span deadline (``deadline_exceeded`` after ``DEADLINE_MS``), ``fast`` rounds to calc.
Rounds alternate, so both see the same machine. The ratio of the plain requests' median gap
between tokens is the stall ratio (target <= 1.02). Prints it, writes JSON and a plot.

    engine-adapter bench vllm-stall [--rounds 4]

Needs ``.venv-vllm`` (``make vllm-venv``); starts its own evald and vLLM server.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_adapter.testing.vllm import (
    CONFIG,
    DEADLINE_MS,
    SPIN_TOKEN,
    TOKEN,
    VllmServer,
    fixed_tag,
    start_server,
    tag_body,
    vllm_python,
)
from evald_lab.bench._servers import register_spinner

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
    rounds: int = 4,
    plain: int = 4,
    evaluated: int = 4,
    max_tokens: int = 64,
) -> dict[str, Any]:
    """Runs the alternating rounds on ``server`` (whose adapter uses evald at ``target``)."""
    from engine_adapter import list_evaluators

    spin = register_spinner(target, SPIN_TOKEN).binding()
    calc = {s.name: s for s in list_evaluators(target, TOKEN)}["calc"].binding()
    bodies: dict[str, dict[str, Any] | None] = {
        "spinning": tag_body(
            fixed_tag("So ", (spin, "x"), " and ", (spin, "y"), "."), evald_token=SPIN_TOKEN
        ),
        "fast": tag_body(fixed_tag("So ", (calc, "6 * 7"), " and ", (calc, "1 + 1"), "."),
                         evald_token=TOKEN),
        "alone": None,  # the plain requests by themselves: the batch without evaluated rows
    }  # fmt: skip
    gaps: dict[str, list[float]] = {name: [] for name in bodies}
    walls: dict[str, list[float]] = {name: [] for name in bodies}
    texts: dict[str, list[str]] = {name: [] for name in bodies}
    prompts = itertools.cycle(PLAIN_PROMPTS)
    with concurrent.futures.ThreadPoolExecutor(plain + evaluated) as pool:
        for _ in range(rounds):
            for name, body in bodies.items():
                started = time.monotonic()
                evaluated_calls = [
                    pool.submit(server.complete, "Compute:", max_tokens=120, **(body or {}))
                    for _ in range(evaluated if body is not None else 0)
                ]
                streams = [
                    pool.submit(server.stream, next(prompts), max_tokens=max_tokens,
                                ignore_eos=True)
                    for _ in range(plain)
                ]  # fmt: skip
                for stream in streams:
                    _, times = stream.result()
                    gaps[name].extend(b - a for a, b in itertools.pairwise(times))
                for call in evaluated_calls:
                    texts[name].append(call.result()["choices"][0]["text"])
                walls[name].append(time.monotonic() - started)
    medians = {name: statistics.median(values) * 1e3 for name, values in gaps.items()}
    means = {name: statistics.fmean(values) * 1e3 for name, values in gaps.items()}
    maxima = {name: max(values) * 1e3 for name, values in gaps.items()}
    return {
        "rounds": rounds,
        "plain_requests": plain,
        "evaluated_requests": evaluated,
        "span_deadline_ms": DEADLINE_MS,
        "median_gap_ms": medians,
        "mean_gap_ms": means,
        "max_gap_ms": maxima,
        "stall_ratio_median": medians["spinning"] / medians["fast"],
        "stall_ratio_mean": means["spinning"] / means["fast"],
        "ratio_to_alone_median": medians["spinning"] / medians["alone"],
        "round_wall_s": {name: statistics.median(v) for name, v in walls.items()},
        "sample_texts": {name: values[:1] for name, values in texts.items()},
        "gaps_ms": {name: [g * 1e3 for g in values] for name, values in gaps.items()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench vllm-stall``."""
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--plain", type=int, default=4)
    parser.add_argument("--evaluated", type=int, default=4)
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

    with tempfile.TemporaryDirectory(prefix="evald-vllm-") as tmp:
        root = Path(tmp)
        daemon: DaemonProcess = start_daemon(root / "evald", CONFIG)
        try:
            env = {
                "EVALD_TARGET": daemon.target,
                "EVALD_TOKEN": TOKEN,
                "EVALD_DEADLINE_MS": str(DEADLINE_MS),
            }
            server = start_server(python, env, root / "vllm.log")
            try:
                result = measure_stall(
                    server, daemon.target, rounds=args.rounds, plain=args.plain,
                    evaluated=args.evaluated,
                )  # fmt: skip
            finally:
                server.stop()
        finally:
            daemon.stop()
    print(
        f"plain requests' median gap between tokens: {result['median_gap_ms']['spinning']:.1f} ms "
        f"next to spinning spans, {result['median_gap_ms']['fast']:.1f} ms next to fast ones: "
        f"stall ratio {result['stall_ratio_median']:.3f} (mean {result['stall_ratio_mean']:.3f}); "
        f"longest gap {result['max_gap_ms']['spinning']:.0f} ms vs "
        f"{result['max_gap_ms']['fast']:.0f} ms (span deadline {DEADLINE_MS} ms); without "
        f"evaluated requests {result['median_gap_ms']['alone']:.1f} ms "
        f"(ratio {result['ratio_to_alone_median']:.3f})"
    )
    print("spinning:", result["sample_texts"]["spinning"])
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in result.items() if k != "gaps_ms"}
    (args.out / "stall.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0  # the results are written; matplotlib draws the plot
    figure, axis = plt.subplots(figsize=(6, 3.2))
    names = ["alone", "fast", "spinning"]
    axis.boxplot([result["gaps_ms"][n] for n in names], showfliers=True)
    axis.set_xticks([1, 2, 3], ["plain only", "next to fast spans", "next to spinning spans"])
    axis.set_ylabel("plain request: ms between tokens")
    axis.set_title(f"stall ratio {result['stall_ratio_median']:.3f} (median gap)")
    figure.tight_layout()
    figure.savefig(args.out / "stall.png", dpi=120)
    return 0
