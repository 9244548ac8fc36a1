"""The vLLM adapter's cost per row and step, for a batch of 256 evaluated requests.

What the engine core does per step for each evaluated request: the scheduler hook reads the
step's token into the request's injector (:meth:`SpanTracker.before_schedule`) and the bitmask
hook looks at rows with something to force (:meth:`SpanTracker.narrow_bitmask`). Measured side
by side, step by step, against the bare loop that appends the token (what vLLM does anyway):

- ``free``: tokens of free text, none of which can touch a span boundary (the target: <= 2 us);
- ``spans``: a text with a closed span every few dozen tokens, evaluated by a completed
  future (no evald round trip), so the rows also pay for detection, planning and forcing.

The request objects carry only what the hooks read from vLLM's ``Request`` (id, live output
list, finished flag, ``next_decode_eligible_step``); the tracker, injectors and codec are the
real ones. Prints the numbers and writes JSON and a plot.

    engine-adapter bench vllm-overhead [--rows 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine_adapter import TokenCodec, build_structural_tag, standard_evaluators
from engine_adapter.local import load_tokenizer
from engine_adapter.testing.vllm import GrammarOutput, tracker_rows

#: Relative to the checkout the command runs in, like every benchmark's results.
REPORT_DIR = Path("reports") / "vllm"
FREE_TEXT = (
    "The committee met on Tuesday to review the budget and the plans for the new library, "
    "which the town has wanted for years; most members agreed that the reading rooms should "
    "open early and close late, so that students and workers can both use them. "
)
SPAN_TEXT = "So the total is <calc>17 * 23 + 91</calc><result>482</result> items, as counted. "


def measure(
    codec: TokenCodec, text: str, rows: int, steps: int, tag: dict[str, Any]
) -> dict[str, Any]:
    ids = codec.encode_continuation((text * (steps // 10 + 2)).encode())[:steps]
    tracker, scheduler = tracker_rows(codec, rows, tag)
    _, bare = tracker_rows(codec, rows, tag)
    words = (codec.vocab_size + 31) // 32
    order = list(scheduler.requests)
    adapter_s: list[float] = []
    bare_s: list[float] = []
    for step, token in enumerate(ids):
        bitmask = np.full((rows, words), -1, dtype=np.int32)
        grammar_output = GrammarOutput(order, bitmask)
        started = time.perf_counter()
        for request in bare.running:
            request.output_token_ids.append(token)
        bare_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for request in scheduler.running:
            request.output_token_ids.append(token)
        tracker.before_schedule(scheduler)
        tracker.narrow_bitmask(grammar_output)
        adapter_s.append(time.perf_counter() - started)
        scheduler.current_step = step + 1
    per_row = [(a - b) / rows * 1e6 for a, b in zip(adapter_s, bare_s, strict=True)]
    return {
        "rows": rows,
        "steps": len(ids),
        "median_us_per_row": statistics.median(per_row),
        "p90_us_per_row": sorted(per_row)[int(0.9 * len(per_row))],
        "median_ms_per_step": statistics.median(adapter_s) * 1e3,
        "bare_ms_per_step": statistics.median(bare_s) * 1e3,
        "forced_tokens": tracker.stats.forced_tokens,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench vllm-overhead``."""
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=REPORT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    codec = TokenCodec.from_tokenizer(load_tokenizer())
    grammar = build_structural_tag(standard_evaluators(["calc"]), "grammar-eval")
    assert grammar.structural_tag is not None
    results = {
        name: measure(codec, text, args.rows, args.steps, grammar.structural_tag)
        for name, text in (("free", FREE_TEXT), ("spans", SPAN_TEXT))
    }
    for name, result in results.items():
        print(
            f"{name:6s} {result['rows']} rows: {result['median_us_per_row']:.2f} us per row and "
            f"step (p90 {result['p90_us_per_row']:.2f}), {result['median_ms_per_step']:.2f} ms "
            f"per step, {result['forced_tokens']} tokens forced"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(results, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0  # the results are written; matplotlib draws the plot
    figure, axis = plt.subplots(figsize=(5, 3))
    names = list(results)
    axis.bar(names, [results[n]["median_us_per_row"] for n in names], color=["#4c72b0", "#dd8452"])
    axis.axhline(2.0, color="grey", linestyle="--", label="target 2 us")
    axis.set_ylabel("us per row and step (median)")
    axis.set_title(f"vLLM adapter cost, {args.rows} evaluated rows")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "overhead.png", dpi=120)
    return 0
