"""What the operands option costs the grammar: compile time and mask fill, with against without.

``engine-adapter bench operands`` builds, for each question of the held-out study set
(:mod:`evald_lab.study.heldout`), the engine's span grammar over all five standard evaluators with
the study's forced prefix (``The expression is <calc>`` or ``<strop>``), once as usual and once
with the operands option (:func:`engine_adapter.narrow_to_operands` on the question), and
measures on SmolLM2's tokenizer, with XGrammar's cache off:

- **narrowing**: finding the question's literals and checking each against its rule (the
  adapter's own work, before XGrammar sees the grammar);
- **compile**: ``GrammarCompiler.compile_structural_tag`` of each grammar. A server compiles the
  usual grammar once and reuses it (a cache hit); a narrowed grammar is the request's own, so its
  compile is paid on every request: the table gives both;
- **mask fill**: ``fill_next_token_bitmask`` at each token of the question's correct span (the
  same tokens in both grammars), inside the span.

The two grammars of a question are measured back to back, in alternating order, so a burst of
load on a shared machine hits both alike; the report gives medians and 90th percentiles and the
ratio of the medians. A second part grows the text (10 to 200 numbers) to show how the
narrowed grammar's compile grows with its alternatives (capped at
``MAX_LITERALS_PER_RULE`` per rule).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PROFILES", "OperandsProfile", "add_arguments", "main", "run_operands"]


@dataclass(frozen=True)
class OperandsProfile:
    """How much to measure."""

    questions_per_task: int
    repeats: int
    literal_counts: tuple[int, ...]


PROFILES = {
    "tiny": OperandsProfile(questions_per_task=2, repeats=1, literal_counts=(10,)),
    "full": OperandsProfile(questions_per_task=20, repeats=3, literal_counts=(10, 50, 200)),
}

_TASKS = {"arithmetic": "calc", "letters": "strop"}
_LEAD = "The expression is "


def _stats(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median": statistics.median(ordered), "p90": p90, "n": len(ordered)}


def _correct_span(task: str, item: Any) -> str:
    if task == "arithmetic":
        return str(item.params["expression"])
    return f'count("{item.params["word"]}", "{item.params["letter"]}")'


def run_operands(
    profile: str = "full",
    *,
    out_dir: Path = Path("reports/bench"),
    plot: bool = True,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Runs the benchmark and writes ``operands.json`` (and ``operands.png``) under ``out_dir``.

    Returns:
        The document written.
    """
    import xgrammar as xgr

    from engine_adapter import (
        build_structural_tag,
        narrow_to_operands,
        special_token_texts,
        standard_evaluators,
    )
    from engine_adapter.local import load_tokenizer
    from evald_lab.bench._common import load_average, machine_info, progress, write_json
    from evald_lab.study.run import items_for

    settings = PROFILES[profile]
    machine = machine_info()
    tokenizer = load_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    specials = special_token_texts(tokenizer)
    specs = standard_evaluators()
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    samples: dict[str, list[float]] = {
        key: []
        for key in (
            "narrow_ms",
            "compile_plain_ms",
            "compile_operands_ms",
            "fill_plain_us",
            "fill_operands_us",
        )
    }
    questions = [
        (task, item)
        for task in _TASKS
        for item in items_for("heldout", task, settings.questions_per_task, 20240601)
    ]

    def grammar_json(text: str | None, prefix: str) -> str:
        return build_structural_tag(
            specs, "grammar-eval", prefix=prefix, special_tokens=specials, operands_from=text
        ).json()

    def fills(compiled: Any, prefix: str, span: str, evaluator: str) -> list[float]:
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert matcher.accept_token(token)
        out = []
        for token in tokenizer.encode(f"{span}</{evaluator}>", add_special_tokens=False):
            started = time.perf_counter_ns()
            matcher.fill_next_token_bitmask(bitmask)
            out.append((time.perf_counter_ns() - started) / 1000)
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused the correct span {span!r}")
        return out

    with progress(show_progress) as bars:
        bars.task("questions", len(questions) * settings.repeats)
        for repeat in range(settings.repeats):
            for index, (task, item) in enumerate(questions):
                evaluator = _TASKS[task]
                prefix = f"{_LEAD}<{evaluator}>"
                started = time.perf_counter()
                narrow_to_operands(specs, item.prompt)
                samples["narrow_ms"].append((time.perf_counter() - started) * 1000)
                order = ("plain", "operands") if (index + repeat) % 2 == 0 else (
                    "operands", "plain")
                for kind in order:
                    text = item.prompt if kind == "operands" else None
                    tag = grammar_json(text, prefix)
                    started = time.perf_counter()
                    compiled = compiler.compile_structural_tag(tag)
                    samples[f"compile_{kind}_ms"].append((time.perf_counter() - started) * 1000)
                    samples[f"fill_{kind}_us"].extend(
                        fills(compiled, prefix, _correct_span(task, item), evaluator)
                    )
                bars.advance("questions")
        growth = []
        bars.task("growth", len(settings.literal_counts))
        for count in settings.literal_counts:
            text = "Numbers: " + ", ".join(str(7 * n + 3) for n in range(count))
            times = []
            for _ in range(settings.repeats):
                started = time.perf_counter()
                compiler.compile_structural_tag(grammar_json(text, f"{_LEAD}<calc>"))
                times.append((time.perf_counter() - started) * 1000)
            growth.append({"numbers_in_text": count, "compile_ms": _stats(times)})
            bars.advance("growth")

    summary = {key: _stats(values) for key, values in samples.items()}
    document = {
        "benchmark": "operands",
        "profile": profile,
        "questions": len(questions),
        "repeats": settings.repeats,
        "grammar": "all five standard evaluators, the study's forced prefix",
        "summary": summary,
        "ratios": {
            "compile_operands_vs_plain": summary["compile_operands_ms"]["median"]
            / summary["compile_plain_ms"]["median"],
            "fill_operands_vs_plain": summary["fill_operands_us"]["median"]
            / summary["fill_plain_us"]["median"],
        },
        "growth": growth,
        "machine": {**machine, "load_average_at_end": load_average()},
    }
    write_json(out_dir / "operands.json", document)
    if plot:
        _plot(document, out_dir / "operands.png")
    return document


def _plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = document["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    for ax, (title, unit, keys) in zip(
        axes,
        (
            ("grammar compile", "ms", ("compile_plain_ms", "compile_operands_ms", "narrow_ms")),
            ("mask fill inside the span", "µs", ("fill_plain_us", "fill_operands_us")),
        ),
        strict=False,
    ):
        labels = [key.rsplit("_", 1)[0].replace("_", " ") for key in keys]
        medians = [summary[key]["median"] for key in keys]
        p90s = [summary[key]["p90"] for key in keys]
        ax.bar(labels, medians, color=["#1565c0", "#2e7d32", "#9e9e9e"][: len(keys)])
        ax.errorbar(labels, medians, yerr=[[0] * len(keys), [p - m for p, m in zip(p90s, medians,
                    strict=True)]], fmt="none", color="black", capsize=3)
        for x, value in enumerate(medians):
            ax.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{title} (median, bar to p90)")
        ax.set_ylabel(unit)
    growth = document["growth"]
    axes[2].plot(
        [g["numbers_in_text"] for g in growth],
        [g["compile_ms"]["median"] for g in growth],
        marker="o",
        color="#2e7d32",
    )
    axes[2].axhline(summary["compile_plain_ms"]["median"], color="#1565c0", linestyle="--",
                    label="usual grammar")
    axes[2].set_xlabel("numbers in the text")
    axes[2].set_ylabel("compile ms (median)")
    axes[2].set_title("narrowed grammar compile vs literals")
    axes[2].legend(fontsize=8)
    load = document["machine"].get("load_average_at_start", [])
    fig.suptitle(
        f"operands option, SmolLM2 tokenizer, xgrammar cache off; {document['questions']} "
        f"questions x {document['repeats']}; 1-min load {load[0] if load else '?'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench operands``."""
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="full", help="tiny: for tests"
    )
    parser.add_argument("--out", type=Path, default=Path("reports/bench"), help="results folder")
    parser.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; writes ``operands.json`` (and the plot) under ``--out``."""
    run_operands(
        args.profile, out_dir=args.out, plot=not args.no_plot, show_progress=not args.quiet
    )
    print(f"results in {args.out}/operands.json", file=sys.stderr)
    return 0
