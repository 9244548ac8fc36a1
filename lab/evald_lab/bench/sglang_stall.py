"""Does a pending span hold back the batch? Other requests' inter-token latency on a real SGLang
CPU server while evaluated requests wait for an evaluator that spins to its deadline, divided by
the same while their evaluator answers at once — for both of SGLang's schedulers, with the
adapter's scheduling (``jump``: waiting requests sit out) and without it (``inline``: the step
waits, as before the scheduler hooks).

Each round runs ``--plain`` streamed plain requests next to ``--evaluated`` requests whose
structural tag holds two spans: ``spinning`` rounds send them to a tenant's evaluator that loops
until the span deadline (``deadline_exceeded`` after ``DEADLINE_MS``), ``fast`` rounds to calc,
``alone`` rounds have no evaluated requests. Rounds alternate, so all see the same machine. The
ratio of the plain requests' median gap between tokens, spinning ÷ fast, is the stall ratio
(target <= 1.02). Prints it, writes ``reports/sglang/stall.json`` and a plot.

A spinning evaluator burns a core for its whole deadline. On a 2-core machine that takes the CPU
the model's forward needs (torch's threads then wait on each other, even with evald at nice
19), and every request slows down whatever the scheduler does. ``--isolation cores`` (the
default) gives each its own core, as a deployment would: SGLang with one torch thread on core 0,
evald on core 1, so that what is measured is the scheduling; ``--isolation none`` shares the
cores (both effects, ``stall-shared-cores.json``).

    engine-adapter bench sglang-stall [--rounds 3]

Needs ``.venv-sglang`` (``make sglang-venv``); starts its own evald and SGLang servers.
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

from engine_adapter.testing import PLAIN_PROMPTS as ALL_PLAIN_PROMPTS
from engine_adapter.testing import fixed_tag
from engine_adapter.testing.sglang import (
    CONFIG,
    DEADLINE_MS,
    SCHEDULERS,
    SPIN_TOKEN,
    TOKEN,
    SglangServer,
    sglang_python,
    start_server,
)
from evald_lab.bench._servers import register_spinner

#: Relative to the checkout the command runs in, like every benchmark\'s results.
REPORT_DIR = Path("reports") / "sglang"
MODES = ("inline", "jump")
PLAIN_PROMPTS = ALL_PLAIN_PROMPTS[:6]


def measure_stall(
    server: SglangServer,
    target: str,
    *,
    rounds: int = 3,
    plain: int = 4,
    evaluated: int = 4,
    max_tokens: int = 64,
) -> dict[str, Any]:
    """Runs the alternating rounds on ``server`` (whose adapter uses evald at ``target``)."""
    from engine_adapter import list_evaluators

    spin = register_spinner(target, SPIN_TOKEN).binding()
    calc = {s.name: s for s in list_evaluators(target, TOKEN)}["calc"].binding()
    requests: dict[str, dict[str, Any] | None] = {
        "spinning": {
            "structural_tag": fixed_tag("So ", (spin, "x"), " and ", (spin, "y"), "."),
            "custom_params": {"evald_token": SPIN_TOKEN},
        },
        "fast": {
            "structural_tag": fixed_tag("So ", (calc, "6 * 7"), " and ", (calc, "1 + 1"), ".")
        },
        "alone": None,  # the plain requests by themselves: the batch without evaluated rows
    }
    gaps: dict[str, list[float]] = {name: [] for name in requests}
    walls: dict[str, list[float]] = {name: [] for name in requests}
    texts: dict[str, list[str]] = {name: [] for name in requests}
    prompts = itertools.cycle(PLAIN_PROMPTS)
    with concurrent.futures.ThreadPoolExecutor(plain + evaluated) as pool:
        for _ in range(rounds):
            for name, sampling in requests.items():
                started = time.monotonic()
                evaluated_calls = [
                    pool.submit(server.generate, "Compute:", max_new_tokens=120, **(sampling or {}))
                    for _ in range(evaluated if sampling is not None else 0)
                ]
                streams = [
                    pool.submit(
                        server.stream, next(prompts), max_new_tokens=max_tokens, ignore_eos=True
                    )
                    for _ in range(plain)
                ]
                for stream in streams:
                    _, times = stream.result()
                    gaps[name].extend(b - a for a, b in itertools.pairwise(times))
                for call in evaluated_calls:
                    texts[name].append(call.result()["text"])
                walls[name].append(time.monotonic() - started)
    medians = {name: statistics.median(values) * 1e3 for name, values in gaps.items()}
    means = {name: statistics.fmean(values) * 1e3 for name, values in gaps.items()}
    maxima = {name: max(values) * 1e3 for name, values in gaps.items()}
    return {
        "scheduler": server.scheduler,
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
    """The flags of ``engine-adapter bench sglang-stall``."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain", type=int, default=4)
    parser.add_argument("--evaluated", type=int, default=4)
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--isolation", choices=("cores", "none"), default="cores")
    parser.add_argument("--out", type=Path, default=REPORT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    python = sglang_python()
    if python is None:
        print(
            "error: unavailable: the SGLang venv is absent: run `make sglang-venv` first",
            file=sys.stderr,
        )
        return 2
    from evald.testing import DaemonProcess, start_daemon

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="evald-sgl-") as tmp:
        root = Path(tmp)
        cores = args.isolation == "cores"
        pin = ["taskset", "-c", "1"] if cores else []
        daemon: DaemonProcess = start_daemon(root / "evald", CONFIG, prefix=pin)
        try:
            for scheduler in args.schedulers:
                for mode in args.modes:
                    env = {
                        "EVALD_TARGET": daemon.target,
                        "EVALD_TOKEN": TOKEN,
                        "EVALD_DEADLINE_MS": str(DEADLINE_MS),
                        "EVALD_SGLANG_SCHEDULING": mode,
                        **({"OMP_NUM_THREADS": "1"} if cores else {}),
                    }
                    server = start_server(
                        python, env, root / f"sglang-{scheduler}-{mode}.log",
                        scheduler=scheduler, prefix=["taskset", "-c", "0"] if cores else (),
                    )  # fmt: skip
                    try:
                        result = measure_stall(
                            server, daemon.target, rounds=args.rounds, plain=args.plain,
                            evaluated=args.evaluated,
                        )  # fmt: skip
                    finally:
                        server.stop()
                    result["mode"] = mode
                    result["isolation"] = args.isolation
                    results[f"{scheduler}/{mode}"] = result
                    print(
                        f"{scheduler:8} {mode:6}: plain requests' median gap "
                        f"{result['median_gap_ms']['spinning']:.1f} ms next to spinning spans, "
                        f"{result['median_gap_ms']['fast']:.1f} ms next to fast ones: stall ratio "
                        f"{result['stall_ratio_median']:.3f} (mean "
                        f"{result['stall_ratio_mean']:.3f}); longest gap "
                        f"{result['max_gap_ms']['spinning']:.0f} ms vs "
                        f"{result['max_gap_ms']['fast']:.0f} ms; alone "
                        f"{result['median_gap_ms']['alone']:.1f} ms",
                        flush=True,
                    )
        finally:
            daemon.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {key: {k: v for k, v in r.items() if k != "gaps_ms"} for key, r in results.items()}
    name = "stall" if cores else "stall-shared-cores"
    (args.out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, args.out / f"{name}.png")
    return 0


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.4), sharey=True)
    axes = axes if len(results) > 1 else [axes]
    for axis, (key, result) in zip(axes, results.items(), strict=True):
        names = ["alone", "fast", "spinning"]
        axis.boxplot([result["gaps_ms"][n] for n in names], showfliers=True)
        axis.set_xticks([1, 2, 3], ["alone", "fast", "spinning"])
        axis.set_yscale("log")
        axis.set_title(f"{key}\nratio {result['stall_ratio_median']:.3f}", fontsize=9)
    axes[0].set_ylabel("plain request: ms between tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
