"""``engine-adapter bench vllm-overhead``'s measurement runs (its numbers are printed by the
benchmark, not checked here)."""

from __future__ import annotations

from engine_adapter import TokenCodec, build_structural_tag, standard_evaluators
from engine_adapter.local import load_tokenizer
from evald_lab.bench.vllm_overhead import FREE_TEXT, SPAN_TEXT, measure


def test_overhead_benchmark_runs() -> None:
    codec = TokenCodec.from_tokenizer(load_tokenizer())
    tag = build_structural_tag(standard_evaluators(["calc"]), "grammar-eval").structural_tag
    assert tag is not None
    free = measure(codec, FREE_TEXT, rows=8, steps=40, tag=tag)
    spans = measure(codec, SPAN_TEXT, rows=8, steps=40, tag=tag)
    assert free["steps"] == spans["steps"] == 40
    assert free["forced_tokens"] == 0
    # Each row closed at least one span and had its result forced through the bitmask.
    assert spans["forced_tokens"] >= 8
    assert free["median_us_per_row"] > 0
