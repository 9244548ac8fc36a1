"""The accuracy study: does forcing evaluated results make a small model right more often, do
model-facing instructions help it set the problem up, and does taking the operands from the
question (the operands option) help it more?

Four arms on two tasks, greedy decoding, the same prompts in every arm, each with and without
the instructions rendered from the manifests (:func:`~engine_adapter.render_instructions`: a
system message for a chat model, a few-shot block for a base model): the three modes of
docs/design.md §2 (``no-grammar``, ``grammar-no-eval``, ``grammar-eval``) on the engine's
default grammar (every evaluator it has, each with its full, bounded input language), and
``grammar-eval+operands``: grammar-eval with the operands option, each evaluator's literal
rules narrowed to the literals of the question (:func:`engine_adapter.narrow_to_operands`).

Two problem sets: ``original`` (:mod:`evald_lab.study.items`: six kinds of arithmetic word
problem in three wordings each, letter counting in five phrasings) and ``heldout``
(:mod:`evald_lab.study.heldout`: the same kinds in new wordings and sentence orders, numbers in
words in some, distractors in some).

In both grammar modes the answer is forced to open with a prefix that ends in the span's opening
tag (``The expression is <calc>``; a 135M model never opens a span unprompted), and generation
stops when the result region closes. The instructions' examples use the same lead-in.

The answer of a grammar-mode item is the value in its first result region (written by the model
in ``grammar-no-eval``, by the engine in ``grammar-eval``); of a ``no-grammar`` item, the last
number in the text.

Each failure is split into **wrong extraction** (the model set the problem up wrongly) and
**wrong computation** (set up right, computed wrongly):

- grammar modes, exactly: arithmetic — the span's content is evaluated with the Python
  reference implementation (the executable semantics); content whose value is the truth is a
  correct extraction (any equivalent setup counts). Letters — the span must count the question's
  letter in the question's word (a value check would accept wrong letters with the same count).
  With a correct extraction, a wrong answer is a wrong computation.
- ``no-grammar``, by a documented heuristic: arithmetic — a wrong answer is a wrong computation
  when some equation the model wrote (``A op B = C``) is false, else a wrong extraction; letters
  — a wrong computation when the answer names both the word and the letter (it read the question
  and miscounted), else a wrong extraction.

Each wrong answer of a grammar arm also gets one **cause**, the first that applies:
``span_not_closed`` (no closed span of the task's evaluator within the budget),
``evaluator_error`` (the span's value is an error, in grammar-no-eval the model wrote no value),
``wrong_operands`` (arithmetic: the span's numbers are not those of the question's expression;
letters: its strings are not the question's word and letter), ``wrong_structure`` (the right
operands, combined wrongly: another operator, order or function) and ``wrong_computation`` (set
up right, a wrong value: only grammar-no-eval, where the model writes it). A no-grammar answer
is ``no_number`` or ``wrong_number``. Items with a distractor record whether the span used it.

The **span rate** is the share of items whose answer holds a closed span of the task's evaluator;
the **correct-extraction rate** (grammar modes) the share whose span sets the question up right.
Accuracies come with 95 % Wilson intervals. Modes are compared item by item with the exact
McNemar test (two-sided binomial on the discordant pairs), and so are the runs with and without
instructions.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine_adapter import Mode
from evald_lab.study.items import StudyItem, arithmetic_items, letter_items

__all__ = [
    "CAUSES",
    "EVALUATING_MODES",
    "INSTRUCTION_LEAD",
    "MODES",
    "OPERANDS_ARM",
    "PROBLEM_SETS",
    "PROFILES",
    "TASKS",
    "ItemRecord",
    "StudyConfig",
    "StudyItem",
    "StudySummary",
    "arithmetic_items",
    "classify",
    "complete_items",
    "items_for",
    "letter_items",
    "load_records",
    "mcnemar_exact_p",
    "resummarize",
    "run_study",
    "summarize",
    "wilson_interval",
]

#: The arms: the three modes (their names are ``engine_adapter.Mode``'s), and grammar-eval with
#: the operands option.
OPERANDS_ARM = "grammar-eval+operands"
MODES = (*(mode.value for mode in Mode), OPERANDS_ARM)
#: The arms whose spans the engine evaluates.
EVALUATING_MODES = (Mode.GRAMMAR_EVAL.value, OPERANDS_ARM)
TASKS = ("arithmetic", "letters")
PROBLEM_SETS = ("original", "heldout")
#: The failure causes of a grammar arm, in the order they are tested (see the module doc).
CAUSES = (
    "span_not_closed",
    "evaluator_error",
    "wrong_operands",
    "wrong_structure",
    "wrong_computation",
)
PROFILES = {"tiny": 3, "small": 20, "full": 200}

#: Per task: the evaluator, the forced prefix of the grammar modes, and token budgets.
TASK_EVALUATOR = {"arithmetic": "calc", "letters": "strop"}
#: The text before the span, in the forced prefix and in the instructions' examples.
INSTRUCTION_LEAD = "The expression is "
TASK_PREFIX = {task: f"{INSTRUCTION_LEAD}<{tag}>" for task, tag in TASK_EVALUATOR.items()}
FREE_MAX_NEW_TOKENS = 128
GRAMMAR_MAX_NEW_TOKENS = 48
_STOP = ("</result>", "</result_error>")
#: A base model goes on with another question; its free-text answer is one line (the few-shot
#: examples' form), so it ends at the first line feed.
_BASE_FREE_STOP = ("\n",)
#: Rewrite summary.json and table.md after this many records (an interrupted run leaves a table).
_PARTIAL_EVERY = 30
#: Items per block of the run order (both tasks interleaved, so 5 of each).
_BLOCK = 10

_COUNT_CALL = re.compile(r'count\(\s*"([^"\\]*)"\s*,\s*"([^"\\]*)"\s*\)')
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# Each "number operator" unit is atomic (``(?>…)``): with plain groups, a long chain of numbers
# and operators that ends in no ``=`` (a 128-token answer can be one) made the engine try every
# way of splitting its spaces between adjacent ``\s*``, exponential in the chain's length.
_EQUATION = re.compile(
    r"((?:(?>\(?\s*-?\d[\d,]*(?:\.\d+)?\s*\)?\s*[-+*/x\u00d7\u00f7]\s*))+"
    r"(?>\(?\s*-?\d[\d,]*(?:\.\d+)?\s*\)?))"
    r"\s*=\s*(-?\d[\d,]*(?:\.\d+)?)"
)


@dataclass
class ItemRecord:
    """One (item, mode) run: one line of ``records.jsonl``."""

    task: str
    item_id: int
    mode: str
    instructions: bool
    template: str
    prompt: str
    prefix: str
    truth: str
    text: str
    answer: str | None
    correct: bool
    failure: str | None
    """``None`` when correct; else ``wrong_extraction`` or ``wrong_computation``."""
    failure_detail: str | None
    """Why, in words: ``no closed span``, ``no number in the answer``, ``false equation``…"""
    extraction_ok: bool | None
    cause: str | None = None
    """``None`` when correct; else one of :data:`CAUSES` (grammar arms) or ``no_number`` /
    ``wrong_number`` (no-grammar)."""
    distractor_used: bool | None = None
    """Whether the span used the item's distractor (``None``: no distractor, or no span)."""
    foreign_operands: bool | None = None
    """Whether the span used a literal the question does not hold (a number, or a string, that
    :func:`engine_adapter.literals_in_text` does not find in it); ``None`` without a span."""
    problems: str = "original"
    operands: dict[str, Any] | None = None
    """What the operands option narrowed for this item (its arm only)."""
    span_content: str | None = None
    span_value: str | None = None
    """The reference evaluator's value of the span the model wrote (or ``error:CODE``)."""
    result_value: str | None = None
    result_error: str | None = None
    n_sampled: int = 0
    n_forced: int = 0
    stop_reason: str = ""
    decode_ms: float = 0.0
    eval_wait_ms: float = 0.0
    backend: str = ""
    model: str = ""
    evaluator_mode: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StudyConfig:
    """What to run and where to write it.

    Raises:
        ValueError: unknown tasks or modes, or fewer than one item.
    """

    items_per_task: int = PROFILES["full"]
    seed: int = 20240601
    tasks: tuple[str, ...] = TASKS
    modes: tuple[str, ...] = MODES
    instructions: tuple[bool, ...] = (False, True)
    """Run every item without (``False``) and with (``True``) the rendered instructions."""
    model: str = "smollm2"
    problems: str = "original"
    """The problem set: ``original`` or ``heldout`` (see the module doc)."""
    out_dir: Path = Path("reports/study")
    plot: bool = True
    progress: bool = True
    resume: bool = False
    """Keep the records of an interrupted run in ``out_dir`` (same questions) and run the rest."""
    free_max_new_tokens: int = FREE_MAX_NEW_TOKENS
    grammar_max_new_tokens: int = GRAMMAR_MAX_NEW_TOKENS

    def __post_init__(self) -> None:
        if self.free_max_new_tokens < 1 or self.grammar_max_new_tokens < 1:
            raise ValueError("token budgets must be positive")
        if self.items_per_task < 1:
            raise ValueError("the study needs at least one item per task")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(TASKS)}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
        if not self.instructions or len(set(self.instructions)) != len(self.instructions):
            raise ValueError("instructions: choose off, on or both, each once")
        if self.problems not in PROBLEM_SETS:
            raise ValueError(
                f"unknown problem set {self.problems!r}; choose from {', '.join(PROBLEM_SETS)}"
            )


def _reference(evaluator: str, content: str) -> str:
    """The Python reference value of a span, or ``error:CODE``."""
    from evaluators_wasm.reference import GuestError, reference

    try:
        return reference(evaluator)(content.encode("utf-8"))
    except GuestError as exc:
        return f"error:{exc.code}"
    except Exception as exc:  # a reference bug must not end the study
        return f"error:internal:{type(exc).__name__}"


def _first_span(text: str, evaluator_tag: str) -> tuple[str | None, str | None, str | None]:
    """``(content, result value, result error)`` of the first closed span of this tag."""
    begin, end = f"<{evaluator_tag}>", f"</{evaluator_tag}>"
    start = text.find(begin)
    if start < 0:
        return None, None, None
    close = text.find(end, start + len(begin))
    if close < 0:
        return None, None, None
    content = text[start + len(begin) : close]
    rest = text[close + len(end) :]
    match = re.match(r"<result>(.*?)</result>", rest, re.S)
    if match:
        return content, match.group(1), None
    match = re.match(r"<result_error>(.*?)</result_error>", rest, re.S)
    if match:
        return content, None, match.group(1)
    return content, None, None


def _canonical_number(text: str) -> str:
    cleaned = text.replace(",", "")
    try:
        value = float(cleaned)
    except ValueError:
        return cleaned
    return str(int(value)) if value.is_integer() else cleaned


def _false_equation(text: str) -> bool:
    """Whether the text states an arithmetic equation whose two sides differ."""
    for lhs, rhs in _EQUATION.findall(text):
        expression = lhs.replace(",", "").replace("\u00d7", "*").replace("\u00f7", "/")
        expression = re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", expression)
        value = _reference("calc", expression.strip())
        if value.startswith("error:"):
            continue
        if _canonical_number(value) != _canonical_number(rhs):
            return True
    return False


def classify(item: StudyItem, mode: str, text: str) -> dict[str, Any]:
    """The answer, correctness and failure kind of one generated text (see the module doc)."""
    out: dict[str, Any] = {
        "answer": None,
        "correct": False,
        "failure": None,
        "failure_detail": None,
        "extraction_ok": None,
        "span_content": None,
        "span_value": None,
        "result_value": None,
        "result_error": None,
        "cause": None,
        "distractor_used": None,
        "foreign_operands": None,
    }
    if mode == Mode.NO_GRAMMAR:
        # A span the model wrote on its own (the instructions show how) counts for the span
        # rate; its answer is still the last number in the text.
        out["span_content"] = _first_span(text, TASK_EVALUATOR[item.task])[0]
        numbers = _NUMBER.findall(text)
        answer = _canonical_number(numbers[-1]) if numbers else None
        out["answer"] = answer
        out["correct"] = answer == item.truth
        if out["correct"]:
            return out
        if answer is None:
            out["extraction_ok"] = False
            out["failure_detail"] = "no number in the answer"
        elif item.task == "arithmetic":
            out["extraction_ok"] = _false_equation(text)
            out["failure_detail"] = (
                "a false equation" if out["extraction_ok"] else "only true equations"
            )
        else:
            lowered = text.lower()
            letter = item.params["letter"]
            out["extraction_ok"] = item.params["word"] in lowered and (
                f'"{letter}"' in lowered or f"'{letter}'" in lowered
            )
            out["failure_detail"] = (
                "names the word and the letter"
                if out["extraction_ok"]
                else "does not name the word and the letter"
            )
        out["failure"] = "wrong_computation" if out["extraction_ok"] else "wrong_extraction"
        out["cause"] = "no_number" if answer is None else "wrong_number"
        return out
    evaluator = TASK_EVALUATOR[item.task]
    content, value, error = _first_span(text, evaluator)
    out.update(span_content=content, result_value=value, result_error=error)
    if content is not None and item.params.get("distractor") is not None:
        out["distractor_used"] = str(item.params["distractor"]) in _span_operands(item, content)
    if content is not None:
        out["foreign_operands"] = _uses_foreign_operands(item, content)
    if content is not None:
        out["span_value"] = _reference(evaluator, content)
        counted = _COUNT_CALL.fullmatch(content.strip())
        if item.task == "letters" and counted is not None:
            out["extraction_ok"] = counted.groups() == (
                item.params["word"],
                item.params["letter"],
            )
        else:
            out["extraction_ok"] = out["span_value"] == item.truth
    else:
        out["extraction_ok"] = False
    out["answer"] = value
    out["correct"] = value is not None and _canonical_number(value) == item.truth
    if out["correct"]:
        return out
    if content is None:
        out["failure"], out["failure_detail"] = "wrong_extraction", "no closed span"
    elif not out["extraction_ok"]:
        out["failure"], out["failure_detail"] = "wrong_extraction", "span sets up another question"
    elif value is None:
        out["failure"] = "wrong_computation"
        out["failure_detail"] = f"error {error}" if error else "no closed result region"
    else:
        out["failure"], out["failure_detail"] = "wrong_computation", "wrong value"
    out["cause"] = _cause(item, content, value, bool(out["extraction_ok"]))
    return out


def _cause(item: StudyItem, content: str | None, value: str | None, extraction_ok: bool) -> str:
    """The first of :data:`CAUSES` that explains a wrong grammar-arm answer."""
    if content is None:
        return "span_not_closed"
    if value is None:
        return "evaluator_error"
    if extraction_ok:
        return "wrong_computation"
    if set(_span_operands(item, content)) != set(_question_operands(item)):
        return "wrong_operands"
    return "wrong_structure"


_SPAN_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_SPAN_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _question_operands(item: StudyItem) -> list[str]:
    """The literals the question's setup uses: the numbers of its expression, or its word and
    letter."""
    if item.task == "arithmetic":
        return _SPAN_NUMBER.findall(item.params["expression"])
    return [item.params["word"], item.params["letter"]]


def _span_operands(item: StudyItem, content: str) -> list[str]:
    """The literals a span uses: its numbers (canonical), or its string literals."""
    if item.task == "arithmetic":
        return [_canonical_number(n) for n in _SPAN_NUMBER.findall(content)]
    return _SPAN_STRING.findall(content)


def _uses_foreign_operands(item: StudyItem, content: str) -> bool:
    """Whether a span uses a literal its question does not hold (as the operands option reads
    the question: number words as digits, words as strings)."""
    from engine_adapter import literals_in_text

    if item.task == "arithmetic":
        held = {_canonical_number(n) for n in literals_in_text("number", item.prompt)}
    else:
        held = {json.loads(s) for s in literals_in_text("string", item.prompt)}
    return any(operand not in held for operand in _span_operands(item, content))


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default): ``(low, high)``; it stays
    inside [0, 1] and is sound near 0 and 1, where the normal approximation is not."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: ``b`` and ``c`` are the discordant pair counts (A right
    and B wrong, A wrong and B right); under H0 each discordant pair goes either way with
    probability 1/2."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return float(min(1.0, 2 * tail))


@dataclass
class StudySummary:
    """Rates per (instructions, task, mode), paired comparisons, and the checks."""

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]
    checks: dict[str, Any]
    by_template: list[dict[str, Any]] = field(default_factory=list)

    def table_markdown(self) -> str:
        lines = []
        if self.config.get("partial"):
            lines += [f"(partial run: {sum(r['n'] for r in self.rows)} records so far)", ""]
        lines += [
            "| task | instructions | mode | n | span rate | correct extraction | accuracy "
            "| 95% CI | wrong extraction | wrong computation |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            extraction = (
                "n/a" if row["mode"] == Mode.NO_GRAMMAR else f"{row['extraction_rate'] * 100:.1f}%"
            )
            low, high = row.get("accuracy_ci95", (0.0, 1.0))
            lines.append(
                f"| {row['task']} | {_on(row['instructions'])} | {row['mode']} | {row['n']} | "
                f"{row['span_rate'] * 100:.1f}% | {extraction} | "
                f"{row['accuracy'] * 100:.1f}% ({row['correct']}) | "
                f"{low * 100:.1f}-{high * 100:.1f}% | {row['wrong_extraction']} | "
                f"{row['wrong_computation']} |"
            )
        lines += ["", *self.causes_markdown()]
        lines += [
            "",
            "| task | instructions | mode | spans | a literal not in the question | items with "
            "a distractor | span used it |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            if row["mode"] == Mode.NO_GRAMMAR:
                continue
            spans = row.get("spans", 0)
            foreign = row.get("foreign_operands", 0)
            distracted = row.get("distractor_items", 0)
            used = row.get("distractor_used", 0)
            lines.append(
                f"| {row['task']} | {_on(row['instructions'])} | {row['mode']} | {spans} | "
                f"{foreign} ({foreign / spans * 100 if spans else 0:.1f}%) | {distracted} | "
                + (f"{used} ({used / distracted * 100:.1f}%) |" if distracted else "— |")
            )
        lines += [
            "",
            "| task | A vs B | pairs | only A right | only B right | exact McNemar p |",
            "|---|---|---|---|---|---|",
        ]
        for comp in self.comparisons:
            lines.append(
                f"| {comp['task']} | {comp['a']} vs {comp['b']} | {comp['pairs']} | "
                f"{comp['only_a']} | {comp['only_b']} | {_format_p(comp['p_value'])} |"
            )
        check = self.checks.get("grammar_eval_correct_when_extracted")
        if check:
            lines += ["", "evaluated arms on items whose span was set up correctly:"]
            for key, value in check.items():
                lines.append(
                    f"- {key}: {value['correct']} / {value['extracted']} correct, "
                    f"{value['wrong_computation']} wrong computations"
                )
        return "\n".join(lines)


    def causes_markdown(self) -> list[str]:
        """The failures of each row by cause (:data:`CAUSES`), counts and shares."""
        causes = [*CAUSES, "no_number", "wrong_number"]
        present = [c for c in causes if any(row.get("causes", {}).get(c) for row in self.rows)]
        lines = [
            "| task | instructions | mode | failures | "
            + " | ".join(c.replace("_", " ") for c in present)
            + " |",
            "|---|---|---|---|" + "---|" * len(present),
        ]
        for row in self.rows:
            failures = row["n"] - row["correct"]
            cells = [
                f"{n} ({n / failures * 100:.0f}%)" if (n := row.get("causes", {}).get(c, 0))
                else "0"
                for c in present
            ]
            lines.append(
                f"| {row['task']} | {_on(row['instructions'])} | {row['mode']} | {failures} | "
                + " | ".join(cells)
                + " |"
            )
        return lines


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _format_p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _rates(group: Sequence[ItemRecord]) -> dict[str, Any]:
    n = len(group)
    correct = sum(r.correct for r in group)
    low, high = wilson_interval(correct, n)
    distracted = [r for r in group if r.params.get("distractor") is not None]
    return {
        "n": n,
        "correct": correct,
        "accuracy": correct / n,
        "accuracy_ci95": [low, high],
        "causes": {
            cause: sum(r.cause == cause for r in group)
            for cause in sorted({r.cause for r in group if r.cause is not None})
        },
        "distractor_items": len(distracted),
        "distractor_used": sum(bool(r.distractor_used) for r in distracted),
        "spans": sum(r.span_content is not None for r in group),
        "foreign_operands": sum(bool(r.foreign_operands) for r in group),
        "span_rate": sum(r.span_content is not None for r in group) / n,
        "extraction_rate": sum(bool(r.extraction_ok) for r in group) / n,
        "wrong_extraction": sum(r.failure == "wrong_extraction" for r in group),
        "wrong_computation": sum(r.failure == "wrong_computation" for r in group),
    }


def _compare(
    records: Sequence[ItemRecord], task: str, a: tuple[bool, str], b: tuple[bool, str]
) -> dict[str, Any]:
    """McNemar between two conditions (instructions, mode) over the items both ran."""

    def outcomes(cond: tuple[bool, str]) -> dict[int, bool]:
        return {
            r.item_id: r.correct
            for r in records
            if r.task == task and (r.instructions, r.mode) == cond
        }

    left, right = outcomes(a), outcomes(b)
    shared = sorted(set(left) & set(right))
    only_a = sum(left[k] and not right[k] for k in shared)
    only_b = sum(right[k] and not left[k] for k in shared)
    return {
        "task": task,
        "a": f"{a[1]} ({_on(a[0])})",
        "b": f"{b[1]} ({_on(b[0])})",
        "pairs": len(shared),
        "only_a": only_a,
        "only_b": only_b,
        "p_value": mcnemar_exact_p(only_a, only_b),
    }


def summarize(records: Sequence[ItemRecord], config: dict[str, Any]) -> StudySummary:
    """Rates, McNemar comparisons, per-template accuracy and checks from the per-item records.

    Comparisons: every pair of modes with the same instructions, and each mode without vs with
    the instructions.
    """
    tasks = list(dict.fromkeys(r.task for r in records))
    modes = [m for m in MODES if any(r.mode == m for r in records)]
    flags = [f for f in (False, True) if any(r.instructions is f for r in records)]
    rows, by_template = [], []
    for task in tasks:
        for flag in flags:
            for mode in modes:
                group = [
                    r for r in records
                    if r.task == task and r.mode == mode and r.instructions is flag
                ]
                if not group:
                    continue
                tokens = sum(r.n_sampled + r.n_forced for r in group)
                seconds = sum(r.decode_ms for r in group) / 1000
                rows.append(
                    {
                        "task": task,
                        "instructions": flag,
                        "mode": mode,
                        **_rates(group),
                        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                        "mean_decode_ms": sum(r.decode_ms for r in group) / len(group),
                    }
                )
                for template in sorted({r.template for r in group}):
                    part = [r for r in group if r.template == template]
                    by_template.append(
                        {"task": task, "instructions": flag, "mode": mode,
                         "template": template, **_rates(part)}
                    )
    comparisons = []
    for task in tasks:
        for flag in flags:
            for i, a in enumerate(modes):
                for b in modes[i + 1 :]:
                    comparisons.append(_compare(records, task, (flag, a), (flag, b)))
        if len(flags) == 2:
            for mode in modes:
                comparisons.append(_compare(records, task, (False, mode), (True, mode)))
    extracted: dict[str, Any] = {}
    engine_agrees = {"spans": 0, "disagreements": 0}
    for task, flag, arm in itertools.product(tasks, flags, EVALUATING_MODES):
        evaluated = [
            r for r in records if r.task == task and r.mode == arm and r.instructions is flag
        ]
        if not evaluated:
            continue
        good = [r for r in evaluated if r.extraction_ok]
        extracted[f"{task}, {arm}, instructions {_on(flag)}"] = {
            "extracted": len(good),
            "correct": sum(r.correct for r in good),
            "wrong_computation": sum(r.failure == "wrong_computation" for r in good),
        }
        for r in evaluated:
            if r.span_content is None or r.result_value is None:
                continue
            engine_agrees["spans"] += 1
            if r.span_value is None or r.span_value.startswith("error:"):
                engine_agrees["disagreements"] += 1
            elif _canonical_number(r.result_value) != _canonical_number(r.span_value):
                engine_agrees["disagreements"] += 1
    return StudySummary(
        config=config,
        rows=rows,
        comparisons=comparisons,
        checks={
            "grammar_eval_correct_when_extracted": extracted,
            "grammar_eval_result_equals_reference": engine_agrees,
        },
        by_template=by_template,
    )


def complete_items(records: Sequence[ItemRecord]) -> list[ItemRecord]:
    """The records of the items that ran in every condition (instructions x mode) present: a
    run cut short is summarised over paired items only."""
    conditions = {(r.instructions, r.mode) for r in records}
    seen: dict[tuple[str, int], set[tuple[bool, str]]] = {}
    for r in records:
        seen.setdefault((r.task, r.item_id), set()).add((r.instructions, r.mode))
    whole = {key for key, got in seen.items() if got == conditions}
    return [r for r in records if (r.task, r.item_id) in whole]


def load_records(path: Path) -> list[ItemRecord]:
    """The records of a ``records.jsonl`` (a line cut short by an interruption is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(ItemRecord(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def resummarize(out_dir: Path, *, plot: bool = True) -> StudySummary:
    """Re-scores the records in ``out_dir`` (the texts are kept, so scoring can be re-run
    without the model), keeps the items that ran in every condition, and rewrites
    ``summary.json``, ``table.md`` and the plot. The run's settings come from the old summary.

    Raises:
        FileNotFoundError: no ``records.jsonl`` there.
    """
    records = load_records(out_dir / "records.jsonl")
    old = out_dir / "summary.json"
    config: dict[str, Any] = (
        json.loads(old.read_text(encoding="utf-8"))["config"] if old.exists() else {}
    )
    n = max((r.item_id for r in records), default=-1) + 1
    seed = int(config.get("seed", StudyConfig.seed))
    problems = str(config.get("problems", "original"))
    items = {
        (item.task, item.item_id): item
        for task in TASKS
        for item in items_for(problems, task, n, seed)
    }
    rescored = []
    for r in records:
        item = items.get((r.task, r.item_id))
        if item is None or item.prompt != r.prompt:
            continue
        rescored.append(replace(r, **classify(item, r.mode, r.text)))
    kept = complete_items(rescored)
    completed = len({(r.task, r.item_id) for r in kept})
    config = {**config, "partial": False, "items_completed": completed}
    summary = summarize(kept, config)
    _write_summary(summary, out_dir)
    if plot:
        _plot(summary, out_dir / "study.png")
    return summary


#: The plot's stack: correct answers, then each cause of failure.
_PLOT_PARTS = (
    ("correct", "#2e7d32"),
    ("span_not_closed", "#9e9e9e"),
    ("wrong_operands", "#f9a825"),
    ("wrong_structure", "#ef6c00"),
    ("evaluator_error", "#6a1b9a"),
    ("wrong_computation", "#c62828"),
    ("free_text", "#90a4ae"),
)


def _plot(summary: StudySummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in summary.rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(7.2 * len(tasks), 4.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = [row for row in summary.rows if row["task"] == task]
        labels = [
            row["mode"].replace("grammar-", "g-").replace("+", "\n+")
            + ("\n+instr" if row["instructions"] else "")
            for row in rows
        ]
        bottom = [0.0] * len(rows)
        for key, colour in _PLOT_PARTS:
            heights = [_plot_count(row, key) / row["n"] * 100 for row in rows]
            if not any(heights):
                continue
            ax.bar(labels, heights, bottom=bottom, color=colour, label=key.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, row in enumerate(rows):
            low, high = row.get("accuracy_ci95", (row["accuracy"], row["accuracy"]))
            accuracy = row["accuracy"] * 100
            spread = [[max(0.0, accuracy - low * 100)], [max(0.0, high * 100 - accuracy)]]
            ax.errorbar(x, accuracy, yerr=spread,
                        color="black", capsize=3, linewidth=1)
            ax.text(x + 0.28, max(accuracy, 3), f"{accuracy:.0f}%", ha="left", va="center",
                    color="black", fontsize=8, fontweight="bold")
        ax.set_title(f"{task} (n = {rows[0]['n']})")
        ax.set_ylabel("% of items (bars: 95% Wilson interval of the accuracy)")
        ax.set_ylim(0, 100)
        ax.tick_params(axis="x", labelsize=8)
    # one legend for every part drawn on any axis, in the stack's order
    drawn: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            drawn.setdefault(label, handle)
    order = [key.replace("_", " ") for key, _ in _PLOT_PARTS if key.replace("_", " ") in drawn]
    axes[0][-1].legend([drawn[label] for label in order], order, loc="upper left",
                       bbox_to_anchor=(1.0, 1.0), fontsize=8)
    title = summary.config.get("model_title", "")
    backend = summary.config.get("backend", "")
    problems = summary.config.get("problems", "original")
    fig.suptitle(
        f"{title}, greedy, {backend} backend, {problems} problems: answers by arm and cause"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_count(row: dict[str, Any], part: str) -> int:
    causes = row.get("causes", {})
    if part == "correct":
        return int(row["correct"])
    if part == "free_text":
        return int(causes.get("no_number", 0) + causes.get("wrong_number", 0))
    return int(causes.get(part, 0))


def run_study(
    engine: Any,
    config: StudyConfig,
    *,
    evaluator_mode: str = "",
    on_record: Callable[[ItemRecord], None] | None = None,
) -> StudySummary:
    """Runs every (instructions, item, mode), writes the results under ``config.out_dir`` and
    returns the summary.

    Files: ``records.jsonl`` (one :class:`ItemRecord` per line, written as the study goes),
    ``summary.json``, ``table.md``, ``instructions.txt`` (the exact text the model was given)
    and ``study.png`` (unless ``config.plot`` is false).

    Parameters:
        engine: a :class:`~engine_adapter.LocalEngine` whose evaluators include ``calc`` and
            ``strop`` and which has an evaluator (``grammar-eval`` needs one). Its
            ``system_prompt`` is set per run and restored afterwards.
    """
    from engine_adapter import render_instructions
    from engine_adapter.local import MODEL_NAMES, model_title

    per_task = [
        items_for(config.problems, task, config.items_per_task, config.seed)
        for task in config.tasks
    ]
    # Tasks interleaved, so that an interrupted run has covered every task equally.
    items = [item for group in zip(*per_task, strict=True) for item in group]
    config.out_dir.mkdir(parents=True, exist_ok=True)
    records_path = config.out_dir / "records.jsonl"
    records: list[ItemRecord] = []
    style = "system" if engine.chat else "few-shot"
    instructions = render_instructions(
        engine.evaluators, style=style, answer_prefix=INSTRUCTION_LEAD
    )
    (config.out_dir / "instructions.txt").write_text(instructions, encoding="utf-8")
    grammars = {  # the operands arm's grammar is each question's own
        (task, mode): engine.span_grammar(mode, TASK_PREFIX[task])
        for task in config.tasks
        for mode in config.modes
        if mode not in (Mode.NO_GRAMMAR, OPERANDS_ARM)
    }
    evaluator_mode = evaluator_mode or type(engine.evaluator).__name__
    total = len(items) * len(config.modes) * len(config.instructions)
    progress, task_id = _progress(config.progress, total)
    started = time.perf_counter()
    original_system = engine.system_prompt

    def meta(*, partial: bool) -> dict[str, Any]:
        return {
            "items_per_task": config.items_per_task,
            "problems": config.problems,
            "seed": config.seed,
            "tasks": list(config.tasks),
            "modes": list(config.modes),
            "instructions": [_on(flag) for flag in config.instructions],
            "instructions_style": style,
            "model": config.model,
            "model_title": model_title(config.model) if config.model in MODEL_NAMES else "",
            "backend": engine.backend.name,
            "evaluator_mode": evaluator_mode,
            "evaluators": [spec.name for spec in engine.evaluators],
            "prefixes": {task: TASK_PREFIX[task] for task in config.tasks},
            "decoding": "greedy",
            "free_max_new_tokens": config.free_max_new_tokens,
            "grammar_max_new_tokens": config.grammar_max_new_tokens,
            "threads": list(getattr(engine.backend, "threads", ()) or ()),
            "wall_s": round(time.perf_counter() - started, 1),
            "partial": partial,
        }

    try:
        done = _resumable(records_path, items, config.modes) if config.resume else {}
        with records_path.open("w", encoding="utf-8") as sink:
            # Blocks of items, each run without and then with the instructions: the long
            # instruction prefix stays in the KV cache within a block, and a run cut short
            # still holds every condition for the same items (see complete_items).
            for start in range(0, len(items), _BLOCK):
                for flag in config.instructions:
                    engine.system_prompt = instructions if flag else original_system
                    for item in items[start : start + _BLOCK]:
                        for mode in config.modes:
                            kept = done.get((flag, item.task, item.item_id, mode))
                            if kept is None:
                                kept = _run_one(
                                    engine, config, item, mode, flag, grammars, evaluator_mode
                                )
                                if on_record is not None:
                                    on_record(kept)
                            records.append(kept)
                            sink.write(json.dumps(asdict(kept), ensure_ascii=False) + "\n")
                            sink.flush()
                            if progress is not None:
                                progress.advance(task_id)
                            if len(records) % _PARTIAL_EVERY == 0:
                                _write_summary(
                                    summarize(complete_items(records), meta(partial=True)),
                                    config.out_dir,
                                )
    finally:
        engine.system_prompt = original_system
        if progress is not None:
            progress.stop()
    summary = summarize(complete_items(records), meta(partial=False))
    _write_summary(summary, config.out_dir)
    if config.plot:
        _plot(summary, config.out_dir / "study.png")
    return summary


def _run_one(
    engine: Any,
    config: StudyConfig,
    item: StudyItem,
    mode: str,
    instructions: bool,
    grammars: dict[tuple[str, str], Any],
    evaluator_mode: str,
) -> ItemRecord:
    grammar = mode != Mode.NO_GRAMMAR
    prefix = TASK_PREFIX[item.task] if grammar else ""
    if grammar:
        stop: tuple[str, ...] = _STOP
    else:
        stop = () if engine.chat else _BASE_FREE_STOP
    operands = mode == OPERANDS_ARM
    result = engine.generate(
        item.prompt,
        mode=Mode.GRAMMAR_EVAL if operands else mode,
        prefix=prefix,
        max_new_tokens=(
            config.grammar_max_new_tokens if grammar else config.free_max_new_tokens
        ),
        stop=stop,
        grammar=grammars.get((item.task, mode)),
        operands_from=item.prompt if operands else None,
    )
    verdict = classify(item, mode, result.text)
    return ItemRecord(
        task=item.task,
        item_id=item.item_id,
        mode=mode,
        instructions=instructions,
        template=item.template,
        prompt=item.prompt,
        prefix=prefix,
        truth=item.truth,
        text=result.text,
        n_sampled=result.n_sampled,
        n_forced=result.n_forced,
        stop_reason=result.stop_reason,
        decode_ms=result.decode_us / 1000,
        eval_wait_ms=sum(s.wait_us for s in result.spans) / 1000,
        backend=result.backend,
        model=config.model,
        evaluator_mode=evaluator_mode,
        params=item.params,
        problems=config.problems,
        operands=_task_operands(result.operands, item.task),
        **verdict,
    )


def _task_operands(report: dict[str, Any] | None, task: str) -> dict[str, Any] | None:
    """The operands report's entry for the task's evaluator (what its span could use)."""
    if report is None:
        return None
    entry = report["evaluators"].get(TASK_EVALUATOR[task])
    return dict(entry) if entry is not None else None


def items_for(problems: str, task: str, n: int, seed: int) -> list[StudyItem]:
    """The first ``n`` questions of a task in a problem set (``original`` or ``heldout``)."""
    from evald_lab.study.heldout import heldout_arithmetic_items, heldout_letter_items

    makers = {
        ("original", "arithmetic"): arithmetic_items,
        ("original", "letters"): letter_items,
        ("heldout", "arithmetic"): heldout_arithmetic_items,
        ("heldout", "letters"): heldout_letter_items,
    }
    return makers[(problems, task)](n, seed)


def _write_summary(summary: StudySummary, out_dir: Path) -> None:
    (out_dir / "summary.json").write_text(
        json.dumps(asdict(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "table.md").write_text(summary.table_markdown() + "\n", encoding="utf-8")


def _resumable(
    path: Path, items: Sequence[StudyItem], modes: Sequence[str]
) -> dict[tuple[bool, str, int, str], ItemRecord]:
    """Records of an earlier run that answer exactly the questions planned now."""
    if not path.exists():
        return {}
    prompts = {(item.task, item.item_id): item.prompt for item in items}
    kept: dict[tuple[bool, str, int, str], ItemRecord] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = ItemRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue  # a line cut short by the interruption
        if record.mode in modes and prompts.get((record.task, record.item_id)) == record.prompt:
            kept[(record.instructions, record.task, record.item_id, record.mode)] = record
    return kept


def _progress(enabled: bool, total: int) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
    )
    progress.start()
    return progress, progress.add_task("study", total=total)
