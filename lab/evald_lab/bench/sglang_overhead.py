"""The SGLang adapter's cost per token, for a batch of 256 evaluated requests.

What SGLang's scheduler thread does per step for each request with a grammar: ``accept_token``
for the token that entered the sequence, then ``fill_vocab_mask`` for the next step. For a
request with evaluated spans the grammar object is the adapter's ``EvaluatorGrammar``, wrapping
SGLang's own ``XGrammarGrammar``. This measures, side by side in the same steps, the wrapped
grammar objects against bare ``XGrammarGrammar`` objects compiled from the same structural tag
(what SGLang pays anyway), so the difference is the adapter's own cost per token. The tokens are
free text, none of which can touch a span boundary (the target: <= 2 us a token).

Both kinds of grammar objects are SGLang's real ones (``XGrammarGrammarBackend`` with the plugin's
hooks, as a scheduler builds it), the tokenizer is SmolLM2's, and evald is a real daemon (free
text never reaches it). Prints the numbers and writes JSON and a plot.

    engine-adapter bench sglang-overhead [--rows 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import unittest.mock
from pathlib import Path
from typing import Any

#: Relative to the checkout the command runs in, like every benchmark's results.
REPORT_DIR = Path("reports") / "sglang"
FREE_TEXT = (
    "The committee met on Tuesday to review the budget and the plans for the new library, "
    "which the town has wanted for years; most members agreed that the reading rooms should "
    "open early and close late, so that students and workers can both use them. "
)


def _ns_per_row(objects: list[Any], token: int, vocab_mask: Any) -> tuple[float, float]:
    """One step over every row: (accept ns per row, fill ns per row)."""
    started = time.perf_counter_ns()
    for grammar in objects:
        grammar.accept_token(token)
    accepted = time.perf_counter_ns()
    for row, grammar in enumerate(objects):
        grammar.fill_vocab_mask(vocab_mask, row)
    filled = time.perf_counter_ns()
    return (accepted - started) / len(objects), (filled - accepted) / len(objects)


def run(rows: int, steps: int, out: Path | None) -> dict[str, Any]:
    """Measures ``steps`` free-text tokens over ``rows`` wrapped and ``rows`` bare grammars."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang.srt.plugins import load_plugins

    from engine_adapter.local import load_tokenizer
    from engine_adapter.sglang import EvaluatorGrammar, structural_tag_for
    from engine_adapter.testing.sglang import CONFIG, TOKEN
    from evald.testing import DaemonProcess, start_daemon

    tokenizer = load_tokenizer()
    ids = [int(t) for t in tokenizer.encode(FREE_TEXT * (1 + steps // 40))][:steps]
    with tempfile.TemporaryDirectory(prefix="evald-sglang-bench-") as tmp:
        daemon: DaemonProcess = start_daemon(Path(tmp), CONFIG)
        try:
            env = {"EVALD_TARGET": daemon.target, "EVALD_TOKEN": TOKEN}
            with unittest.mock.patch.dict(os.environ, env):
                load_plugins()
                backend = XGrammarGrammarBackend(
                    tokenizer,
                    vocab_size=len(tokenizer),
                    model_eos_token_ids=[tokenizer.eos_token_id],
                )
                tag = json.dumps(structural_tag_for(daemon.target, TOKEN, ["calc"]))
                wrapped = [backend.dispatch_structural_tag(tag) for _ in range(rows)]
                assert all(isinstance(g, EvaluatorGrammar) for g in wrapped)
                bare = [g.grammar.copy() for g in wrapped]
                mask = wrapped[0].allocate_vocab_mask(len(tokenizer), rows, "cpu")
                per_step: dict[str, list[float]] = {
                    k: [] for k in ("wrapped_accept", "bare_accept", "wrapped_fill", "bare_fill")
                }
                for step, token in enumerate(ids):
                    # Alternate which kind goes first, so neither always runs on a warm cache.
                    order = ((wrapped, "wrapped"), (bare, "bare"))
                    for objects, kind in order if step % 2 == 0 else order[::-1]:
                        accept_ns, fill_ns = _ns_per_row(objects, token, mask)
                        per_step[f"{kind}_accept"].append(accept_ns)
                        per_step[f"{kind}_fill"].append(fill_ns)
                assert all(g.fault is None and not g.spans for g in wrapped)
        finally:
            daemon.stop()
    adapter_accept = [
        w - b for w, b in zip(per_step["wrapped_accept"], per_step["bare_accept"], strict=True)
    ]
    adapter_fill = [
        w - b for w, b in zip(per_step["wrapped_fill"], per_step["bare_fill"], strict=True)
    ]
    adapter_total = [a + f for a, f in zip(adapter_accept, adapter_fill, strict=True)]

    def us(values: list[float], q: float = 0.5) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000, 3)

    result: dict[str, Any] = {
        "rows": rows,
        "steps": len(ids),
        "bare_accept_us_p50": us(per_step["bare_accept"]),
        "wrapped_accept_us_p50": us(per_step["wrapped_accept"]),
        "bare_fill_us_p50": us(per_step["bare_fill"]),
        "wrapped_fill_us_p50": us(per_step["wrapped_fill"]),
        "adapter_accept_us_p50": us(adapter_accept),
        "adapter_fill_us_p50": us(adapter_fill),
        "adapter_us_per_token_p50": us(adapter_total),
        "adapter_us_per_token_p90": us(adapter_total, 0.9),
        "adapter_us_per_token_mean": round(statistics.fmean(adapter_total) / 1000, 3),
        "target_us": 2.0,
    }
    result["met"] = result["adapter_us_per_token_p50"] <= result["target_us"]
    print(
        f"{rows} rows, {len(ids)} free-text tokens: adapter {result['adapter_us_per_token_p50']} us"
        f" per token (p90 {result['adapter_us_per_token_p90']}; accept "
        f"{result['adapter_accept_us_p50']}, fill {result['adapter_fill_us_p50']}) on top of "
        f"SGLang's own {result['bare_accept_us_p50']} + {result['bare_fill_us_p50']} us; "
        f"target <= 2 us: {'met' if result['met'] else 'NOT met'}"
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
        _plot(per_step, out / "overhead.png", rows)
    return result


def _plot(per_step: dict[str, list[float]], path: Path, rows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["accept_token", "fill_vocab_mask"]
    bare = [statistics.median(per_step[f"bare_{k}"]) / 1000 for k in ("accept", "fill")]
    wrapped = [statistics.median(per_step[f"wrapped_{k}"]) / 1000 for k in ("accept", "fill")]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    positions = range(len(labels))
    axis.bar([p - 0.2 for p in positions], bare, 0.4, label="SGLang's XGrammarGrammar")
    axis.bar([p + 0.2 for p in positions], wrapped, 0.4, label="wrapped by EvaluatorGrammar")
    axis.set_xticks(list(positions), labels)
    axis.set_ylabel("µs per row and step (median)")
    axis.set_title(f"SGLang adapter cost, {rows} rows of free text")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench sglang-overhead``."""
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=REPORT_DIR, help="JSON and plot folder")
    parser.add_argument("--no-write", action="store_true", help="print only")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    run(args.rows, args.steps, None if args.no_write else args.out)
    return 0

