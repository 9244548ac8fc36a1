"""Mask-fill and compile cost of the standard evaluators' grammars on SmolLM2's real tokenizer.

A grammar can be correct and still cost the engine a lot on every decode step: XGrammar's fill of
the next-token bitmask depends on the shape of the rules the matcher stands in. A string literal
written as a repeated alternation of single characters (``char*`` with ``char ::= [^"] | "\\" …``)
took 50-70 ms per fill inside the literal (120-270 ms on a loaded machine); the same language as
runs of a character class, each escape with the run after it, takes 25-140 µs. The structural
side of this is tested in ``test_grammar_cost.py``; this script measures it, so a change can be
compared before and after::

    engine-adapter bench mask-fill                        # every evaluator
    engine-adapter bench mask-fill strop -r 9             # one, more repeats
    engine-adapter bench mask-fill --source-dir OLD/src   # a baseline

Each evaluator's sample text is walked token by token, in two grammars: the evaluator's input
grammar alone (``span``/``literal`` positions), and the adapter's structural tag over all five
evaluators (``free`` text before the span, the span, and — in ``grammar-no-eval`` mode, where the
model writes the result itself — the ``result`` region). Each fill is timed ``--repeat`` times and
the median kept; the table gives the median and the maximum over the positions of each class.
Timings are wall-clock on a shared machine: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from functools import cache
from typing import Any

import xgrammar as xgr

from engine_adapter import Mode, build_structural_tag, special_token_texts, standard_evaluators
from engine_adapter.local import load_tokenizer

#: name -> span content; string literals (with escapes) where the language has them. The result
#: region is walked with the value the Python reference gives.
SAMPLES: dict[str, str] = {
    "calc": "17 * 23 + (4.5 - 2) ** 2",
    "strop": 'replace("strawberry fields, \\"forever\\"", "r", "R\\u00e9")',
    "date": "days_between(2024-01-31 + 1 month, 2024-12-25)",
    "units": "12.5 km to mi",
    "checksum": 'sha256("a \\"quoted\\" \\u00e9 word, and some more text")',
}
FREE_TEXT = "Let me work this out with the tool: "


@cache
def _tokenizer() -> Any:
    return load_tokenizer()


@cache
def _info() -> Any:
    return xgr.TokenizerInfo.from_huggingface(_tokenizer(), vocab_size=len(_tokenizer()))


def _compiler() -> Any:
    return xgr.GrammarCompiler(_info(), cache_enabled=False)


def literal_ranges(text: str) -> list[tuple[int, int]]:
    """Byte ranges of the double-quoted literals of ``text`` (quotes excluded; ``\\`` escapes)."""
    data = text.encode()
    ranges, i = [], 0
    while i < len(data):
        if data[i] == ord('"'):
            start = i = i + 1
            while i < len(data) and data[i] != ord('"'):
                i += 2 if data[i] == ord("\\") else 1
            ranges.append((start, i))
        i += 1
    return ranges


def classify(pieces: Iterable[tuple[str, str]]) -> tuple[str, list[str]]:
    """The text of ``(segment, class)`` pieces and the class of each of its bytes; literals
    inside a ``span`` piece are class ``literal``."""
    text, classes = "", []
    for segment, kind in pieces:
        size = len(segment.encode())
        labels = [kind] * size
        if kind == "span":
            for start, end in literal_ranges(segment):
                labels[start:end] = ["literal"] * (end - start)
        text += segment
        classes += labels
    return text, classes


def time_fills(
    compiled: Any, text: str, classes: list[str], repeat: int, show: bool = False
) -> dict[str, list[float]]:
    """Walks ``text``'s tokens; returns µs per fill, grouped by the class of the next byte.

    With ``show``, prints each position: µs, class, the token that comes next.
    """
    tokenizer, vocab = _tokenizer(), _info().decoded_vocab
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, _info().vocab_size)
    out: dict[str, list[float]] = defaultdict(list)
    offset = 0
    for token in tokenizer.encode(text, add_special_tokens=False):
        samples = []
        for _ in range(repeat):
            start = time.perf_counter_ns()
            matcher.fill_next_token_bitmask(bitmask)
            samples.append((time.perf_counter_ns() - start) / 1000)
        kind = classes[offset] if offset < len(classes) else "end"
        out[kind].append(statistics.median(samples))
        if show:
            print(f"  {statistics.median(samples):>10.1f} µs  {kind:<8} {bytes(vocab[token])!r}")
        if not matcher.accept_token(token):
            raise AssertionError(f"the grammar refused token {token} at byte {offset} of {text!r}")
        offset += len(bytes(vocab[token]))
    return out


def compile_ms(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - start) * 1000


@cache
def _structural_tag(mode: Mode, source_dir: str | None) -> tuple[Any, float]:
    """The adapter's span grammar over all five evaluators, compiled once per mode."""
    specials = special_token_texts(_tokenizer())
    evaluators = standard_evaluators(source_dir=source_dir)
    tag = build_structural_tag(evaluators, mode, special_tokens=specials)
    return compile_ms(_compiler().compile_structural_tag, tag.json())


def measure(
    name: str, repeat: int, show: bool = False, source_dir: str | None = None
) -> dict[str, Any]:
    spec = next(s for s in standard_evaluators(source_dir=source_dir) if s.name == name)
    span = SAMPLES[name]
    value = importlib.import_module(f"evaluators_wasm.reference.{name}").evaluate(span.encode())
    grammar, grammar_ms = compile_ms(_compiler().compile_grammar, spec.input_grammar)
    if show:
        print(f"{name}: input grammar")
    fills = time_fills(grammar, *classify([(span, "span")]), repeat, show)

    for mode in (Mode.GRAMMAR_EVAL, Mode.GRAMMAR_NO_EVAL):
        compiled, tag_ms = _structural_tag(mode, source_dir)
        pieces = [(FREE_TEXT, "free"), (f"<{name}>", "open"), (span, "span"),
                  (f"</{name}>", "close")]
        if mode is Mode.GRAMMAR_NO_EVAL:
            pieces += [("<result>", "open"), (value, "result"), ("</result>", "close")]
        if show:
            print(f"{name}: structural tag, {mode}")
        in_tag = time_fills(compiled, *classify(pieces), repeat, show)
        keys = ("free",) if mode is Mode.GRAMMAR_EVAL else ("result",)
        for key in keys:
            fills[f"tag:{key}"] = in_tag[key]
        if mode is Mode.GRAMMAR_EVAL:
            fills["tag:span"] = in_tag["span"] + in_tag["literal"]
    return {"grammar_ms": grammar_ms, "tag_ms": tag_ms, "fills": fills}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench mask-fill``."""
    parser.add_argument("names", nargs="*", default=list(SAMPLES), help="evaluators to measure")
    parser.add_argument("-r", "--repeat", type=int, default=3, help="fills timed per position")
    parser.add_argument("--positions", action="store_true", help="print every position's fill")
    parser.add_argument("--source-dir", help="read manifests and grammars from DIR/NAME/ "
                        "(default: evaluators_wasm/src), e.g. a checkout of an older version")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    columns = ("span", "literal", "tag:free", "tag:span", "tag:result")
    print(f"{'evaluator':<10}{'compile ms':>11}{'tag ms':>8}  "
          + "".join(f"{c + ' µs (med/max)':>26}" for c in columns))
    for name in args.names:
        row = measure(name, args.repeat, args.positions, args.source_dir)
        cells = []
        for column in columns:
            values = row["fills"].get(column, [])
            cells.append(f"{statistics.median(values):>12.1f} / {max(values):>9.1f}"
                         if values else f"{'-':>24}")
        print(f"{name:<10}{row['grammar_ms']:>11.1f}{row['tag_ms']:>8.0f}  "
              + "".join(f"{c:>26}" for c in cells), flush=True)
    return 0
