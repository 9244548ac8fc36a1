"""What ``engine-adapter bench vs-tools`` reports from its answers: the stated-answer class of
each, the per-path numbers at each concurrency, the ratios against the targets, and the plot."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from engine_adapter.testing import spans_in
from evald_lab.bench._common import percentile
from evald_lab.bench._vs_tools_paths import Answer

__all__ = [
    "STATED_CLASSES",
    "TARGET_ANSWERS_PER_S_RATIO",
    "TARGET_TIME_RATIO",
    "cell_summary",
    "plot",
    "ratios",
    "stated",
]

#: The issue's targets: span ÷ tool time per answer at concurrency 1, and span ÷ tool answers
#: per second at the highest concurrency.
TARGET_TIME_RATIO = 0.6
TARGET_ANSWERS_PER_S_RATIO = 1.5
#: How a final answer states the value it was given.
STATED_CLASSES = ("exact", "rounded_or_reformatted", "different", "missing", "no_value")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def stated(answer: Answer) -> str:
    """``exact``: the value as the evaluator wrote it (for a span, inside its result region);
    ``rounded_or_reformatted``: a number equal to it written otherwise (``1,234``, ``482.0``)
    or within 1 % of it; ``different``: numbers, none of them it; ``missing``: no number;
    ``no_value``: the evaluator gave no value (an error, or no call)."""
    value = answer.value
    if value is None:
        return "no_value"
    if answer.path == "span":
        if any(v == value for _, _, v, _ in spans_in(answer.text)):
            return "exact"
        text = answer.text
    else:
        text = answer.text
        if re.search(rf"(?<![\w.]){re.escape(value)}(?![\w]|\.\d)", text):
            return "exact"
    numbers = [n for n in (_decimal(m) for m in _NUMBER.findall(text)) if n is not None]
    if not numbers:
        return "missing"
    target = _decimal(value)
    if target is not None:
        for number in numbers:
            if number == target or abs(number - target) <= abs(target) / 100:
                return "rounded_or_reformatted"
    return "different"


def _ms(samples: Sequence[float | None]) -> dict[str, float | None]:
    ordered = sorted(s for s in samples if s is not None)
    if not ordered:
        return {"p50_ms": None, "p90_ms": None, "n": 0}
    return {
        "p50_ms": round(percentile(ordered, 0.5) * 1000, 1),
        "p90_ms": round(percentile(ordered, 0.9) * 1000, 1),
        "n": len(ordered),
    }


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 1) if known else None


def cell_summary(answers: Sequence[Answer], wall_s: float) -> dict[str, Any]:
    """One path at one concurrency: times, answers/s over the batches' wall time, tokens
    and requests per answer, the client's time between turns, the stated-answer counts."""
    classes = Counter(stated(a) for a in answers)
    return {
        "answers": len(answers),
        "e2e": _ms([a.e2e_s for a in answers]),
        "value_in_stream": _ms([a.value_in_stream_s for a in answers]),
        "value_at_client": _ms([a.value_at_client_s for a in answers]),
        "between_turns": _ms([a.between_turns_s for a in answers]),
        "tool_run": _ms([a.tool_s for a in answers]),
        "answers_per_s": round(len(answers) / wall_s, 3) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "requests_per_answer": _mean([a.requests for a in answers]),
        "prompt_tokens_per_answer": _mean([a.prompt_tokens for a in answers]),
        "cached_tokens_per_answer": _mean([a.cached_tokens for a in answers]),
        "completion_tokens_per_answer": _mean([a.completion_tokens for a in answers]),
        "stated": {name: classes.get(name, 0) for name in STATED_CLASSES},
        "expression_as_asked": sum(a.expression == a.question.expression for a in answers),
    }


def ratios(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """span ÷ tool time per answer (p50) at the lowest concurrency and span ÷ tool answers/s
    at the highest, against the targets; ``cells[path][concurrency]``."""
    levels = sorted(int(c) for c in cells["span"])
    low, high = str(levels[0]), str(levels[-1])
    span_low, tool_low = cells["span"][low]["e2e"]["p50_ms"], cells["tool"][low]["e2e"]["p50_ms"]
    time_ratio = round(span_low / tool_low, 3) if span_low and tool_low else None
    span_high = cells["span"][high]["answers_per_s"]
    tool_high = cells["tool"][high]["answers_per_s"]
    rate_ratio = round(span_high / tool_high, 3) if span_high and tool_high else None
    return {
        "time_per_answer_span_over_tool": time_ratio,
        "at_concurrency": int(low),
        "time_target": TARGET_TIME_RATIO,
        "time_met": time_ratio is not None and time_ratio <= TARGET_TIME_RATIO,
        "answers_per_s_span_over_tool": rate_ratio,
        "answers_per_s_at_concurrency": int(high),
        "answers_per_s_target": TARGET_ANSWERS_PER_S_RATIO,
        "answers_per_s_met": rate_ratio is not None and rate_ratio >= TARGET_ANSWERS_PER_S_RATIO,
    }


def plot(runs: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Per run (server, quiet or hogs): time per answer (p50, p90 as a bar) and answers/s
    against concurrency, span and tool side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(
        2, max(1, len(runs)), figsize=(4.2 * max(1, len(runs)), 7), squeeze=False
    )
    colours = {"span": "#1565c0", "tool": "#c62828"}
    for column, (key, run) in enumerate(runs.items()):
        top, bottom = axes[0][column], axes[1][column]
        for path_name, cells in run["cells"].items():
            levels = sorted(cells, key=int)
            xs = [int(c) for c in levels]
            p50 = [cells[c]["e2e"]["p50_ms"] or 0 for c in levels]
            p90 = [cells[c]["e2e"]["p90_ms"] or 0 for c in levels]
            top.errorbar(
                xs,
                p50,
                yerr=[[0] * len(xs), [b - a for a, b in zip(p50, p90, strict=True)]],
                marker="o",
                capsize=3,
                color=colours.get(path_name),
                label=path_name,
            )
            rates = [cells[c]["answers_per_s"] or 0 for c in levels]
            bottom.plot(xs, rates, marker="o", color=colours.get(path_name), label=path_name)
        for axis in (top, bottom):
            axis.set_xscale("log", base=2)
            axis.legend(fontsize=8)
        top.set_title(key, fontsize=9)
        top.set_ylabel("ms per answer (p50, bar to p90)")
        bottom.set_ylabel("answers / s")
        bottom.set_xlabel("concurrent answers")
    figure.suptitle("evaluated span vs tool call, same questions, OpenAI API, CPU servers")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
