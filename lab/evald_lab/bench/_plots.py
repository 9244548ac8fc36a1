"""Plots of the benchmark result files (matplotlib, headless). Only reads the JSON documents."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_decode", "plot_overhead"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _row_label(row: dict[str, Any]) -> str:
    if row["path"] == "raw-uds":
        return f"raw uds x{row['items_per_message']} (floor)"
    if row["path"] != "evald":
        return str(row["path"])
    return f"evald {row['transport']} {row['rpc']}x{row['items_per_message']}"


def plot_overhead(document: dict[str, Any], path: Path) -> Path:
    """Left: p50 latency per path at concurrency 1, per input (log scale), with the decode step
    as a line. Right: items/s against concurrency on the short calc input."""
    plt = _pyplot()
    rows: Sequence[dict[str, Any]] = document["rows"]
    inputs = list(dict.fromkeys(row["input"] for row in rows))
    first = [row for row in rows if row["concurrency"] == 1]
    labels = list(dict.fromkeys(_row_label(row) for row in first))
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5))
    width = 0.8 / max(1, len(inputs))
    for i, name in enumerate(inputs):
        by_label = {_row_label(r): r["p50_us"] for r in first if r["input"] == name}
        xs = [x + i * width for x in range(len(labels))]
        left.bar(xs, [by_label.get(label, 0.0) for label in labels], width, label=name)
    step = (document.get("decode_step") or {}).get("p50_us")
    if step:
        left.axhline(step, color="black", linestyle="--", linewidth=1)
        left.text(0, step * 1.1, f"one decode step (llama.cpp) {step / 1000:.1f} ms", fontsize=8)
    left.set_yscale("log")
    left.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    left.set_xticklabels(labels, rotation=70, ha="right", fontsize=7)
    left.set_ylabel("p50 latency per evaluation (µs, log)")
    left.set_title("latency at concurrency 1")
    left.legend(fontsize=8)

    reference_input = "calc-short" if "calc-short" in inputs else inputs[0]
    chosen = [
        r
        for r in rows
        if r["input"] == reference_input
        and (r["path"] not in ("evald", "raw-uds") or r["items_per_message"] in (1, 64))
    ]
    for label in dict.fromkeys(_row_label(r) for r in chosen):
        series = sorted(
            (r["concurrency"], r["evals_per_s"]) for r in chosen if _row_label(r) == label
        )
        right.plot([c for c, _ in series], [v for _, v in series], marker="o", label=label)
    right.axhline(30_000, color="grey", linestyle=":", linewidth=1)
    right.text(1, 31_000, "target 30,000/s", fontsize=8, color="grey")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("concurrent callers")
    right.set_ylabel("evaluations per second (log)")
    right.set_title(f"throughput, {reference_input}")
    right.legend(fontsize=7, loc="lower right")
    machine = document.get("machine", {})
    fig.suptitle(
        f"evald bench overhead ({document.get('profile')}): {machine.get('logical_cpus')} CPUs "
        f"{machine.get('cpu', '')}, load {machine.get('load_average_at_start')}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(document: dict[str, Any], path: Path) -> Path:
    """Left: tokens/s per evaluator mode. Middle: per-span time, in the loop and as a tool call.
    Right: the other sequences' step time with and without a slow span, per engine policy."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    modes = document.get("decode", {}).get("modes", [])
    axes[0].bar([m["mode"] for m in modes], [m["tokens_per_s"] for m in modes], color="#1565c0")
    axes[0].set_ylabel("tokens / s (decode, prefill excluded)")
    axes[0].set_title("decode with spans")
    for x, m in enumerate(modes):
        axes[0].text(x, m["tokens_per_s"], f"{m['tokens_per_s']:.1f}", ha="center", va="bottom")

    tool = document.get("toolcall", {})
    bars = [
        ("in-loop", tool.get("in_loop_span_ms")),
        ("tool call\n(prefix cache)", tool.get("toolcall_cached_span_ms")),
        ("tool call\n(full resubmit)", tool.get("toolcall_span_ms")),
    ]
    shown = [(label, value) for label, value in bars if value is not None]
    axes[1].bar([b[0] for b in shown], [b[1] for b in shown], color="#6a1b9a")
    axes[1].set_ylabel("ms per span (span closed → next token sampled)")
    axes[1].set_title("in-loop vs tool-call")

    stall = document.get("stall", {}).get("policies", [])
    labels = []
    values = []
    for policy in stall:
        for run in ("baseline", "slow"):
            labels.append(f"{policy['policy']}\n{run}")
            values.append(policy[run]["other_step_ms"])
    axes[2].bar(labels, values, color=["#2e7d32", "#c62828"] * max(1, len(stall)))
    axes[2].set_ylabel("other sequences: ms per step")
    axes[2].set_title("batch stall (one span slow up to its deadline)")
    machine = document.get("machine", {})
    fig.suptitle(
        f"evald bench decode ({document.get('profile')}): SmolLM2-135M on llama.cpp, "
        f"{machine.get('logical_cpus')} CPUs, load {machine.get('load_average_at_start')}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
