"""The accuracy study: does forcing evaluated results make a small model right more often?

Three modes (DESIGN §2) on two tasks, greedy decoding, the same prompts in every mode:

- **arithmetic**: "A box has ROWS rows of ITEMS items, then ADDED more are added. How many items
  are in the box?" with seeded random numbers; truth ``ROWS * ITEMS + ADDED``.
- **letters**: "How many times does the letter "L" appear in the word "WORD"?" over real words
  (:data:`~engine_adapter._study_words.STUDY_WORDS`); truth ``WORD.count(L)``.

In both grammar modes the answer is forced to open with a prefix that ends in the span's opening
tag (a 135M model never opens a span unprompted), and generation stops when the result region
closes. For letters the span's content is narrowed to ``count("WORD", "L")`` (an
``EvaluatorSpec`` whose input grammar is replaced; ``strop`` still evaluates it): with the full
``strop`` language the model never opens a string literal (it wants bare words, which the grammar
forbids) and loops on ``substr(substr(…``, so no item would have a span at all.

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

Modes are compared item by item with the exact McNemar test (two-sided binomial on the
discordant pairs).
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_adapter._study_words import STUDY_WORDS

__all__ = [
    "MODES",
    "PROFILES",
    "TASKS",
    "ItemRecord",
    "StudyConfig",
    "StudyItem",
    "StudySummary",
    "arithmetic_items",
    "classify",
    "letter_items",
    "mcnemar_exact_p",
    "run_study",
    "summarize",
]

MODES = ("no-grammar", "grammar-no-eval", "grammar-eval")
TASKS = ("arithmetic", "letters")
PROFILES = {"tiny": 3, "small": 20, "full": 200}

#: Per task: the evaluator, the forced prefix of the grammar modes, and token budgets.
TASK_EVALUATOR = {"arithmetic": "calc", "letters": "strop"}
TASK_PREFIX = {"arithmetic": "The expression is <calc>", "letters": "The expression is <strop>"}
#: Span content narrower than the evaluator's own language, per task (see the module doc).
TASK_CONTENT_GRAMMAR = {"letters": 'root ::= "count(\\"" [a-zA-Z]+ "\\", \\"" [a-zA-Z] "\\")"'}
FREE_MAX_NEW_TOKENS = 160
GRAMMAR_MAX_NEW_TOKENS = 48
_STOP = ("</result>", "</result_error>")
#: Rewrite summary.json and table.md after this many records (an interrupted run leaves a table).
_PARTIAL_EVERY = 30

_COUNT_CALL = re.compile(r'count\(\s*"([^"\\]*)"\s*,\s*"([^"\\]*)"\s*\)')
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_EQUATION = re.compile(
    r"((?:\(?\s*-?\d[\d,]*(?:\.\d+)?\s*\)?\s*[-+*/x\u00d7\u00f7]\s*)+\(?\s*-?\d[\d,]*(?:\.\d+)?\s*\)?)"
    r"\s*=\s*(-?\d[\d,]*(?:\.\d+)?)"
)


@dataclass(frozen=True)
class StudyItem:
    """One question. ``truth`` is the canonical answer as the evaluator would print it."""

    task: str
    item_id: int
    prompt: str
    truth: str
    params: dict[str, Any]


def arithmetic_items(n: int, seed: int) -> list[StudyItem]:
    """``n`` box problems with numbers drawn from a generator seeded by ``seed``."""
    rng = random.Random(f"arithmetic:{seed}")
    items = []
    for i in range(n):
        rows, per_row, added = rng.randint(3, 40), rng.randint(3, 40), rng.randint(2, 99)
        prompt = (
            f"A box has {rows} rows of {per_row} items, then {added} more are added. "
            "How many items are in the box?"
        )
        items.append(
            StudyItem(
                "arithmetic",
                i,
                prompt,
                str(rows * per_row + added),
                {"rows": rows, "items": per_row, "added": added},
            )
        )
    return items


def letter_items(n: int, seed: int) -> list[StudyItem]:
    """``n`` letter-counting questions: distinct words while they last, then words again with
    other letters; the letter occurs in the word four times out of five."""
    rng = random.Random(f"letters:{seed}")
    words = list(STUDY_WORDS)
    rng.shuffle(words)
    items = []
    for i in range(n):
        word = words[i % len(words)]
        present = sorted(set(word))
        if rng.random() < 0.8:
            letter = rng.choice(present)
        else:
            letter = rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c not in word])
        prompt = f'How many times does the letter "{letter}" appear in the word "{word}"?'
        items.append(
            StudyItem(
                "letters", i, prompt, str(word.count(letter)), {"word": word, "letter": letter}
            )
        )
    return items


@dataclass
class ItemRecord:
    """One (item, mode) run: one line of ``records.jsonl``."""

    task: str
    item_id: int
    mode: str
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
    }
    if mode == "no-grammar":
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
        return out
    evaluator = TASK_EVALUATOR[item.task]
    content, value, error = _first_span(text, evaluator)
    out.update(span_content=content, result_value=value, result_error=error)
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
    return out


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
    """Accuracies per (task, mode), paired comparisons, and the engine's throughput."""

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    comparisons: list[dict[str, Any]]
    checks: dict[str, Any]

    def table_markdown(self) -> str:
        lines = []
        if self.config.get("partial"):
            lines += [f"(partial run: {sum(r['n'] for r in self.rows)} records so far)", ""]
        lines += [
            "| task | mode | accuracy | correct / n | wrong extraction | wrong computation "
            "| tok/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            lines.append(
                f"| {row['task']} | {row['mode']} | {row['accuracy'] * 100:.1f}% | "
                f"{row['correct']} / {row['n']} | {row['wrong_extraction']} | "
                f"{row['wrong_computation']} | {row['tokens_per_s']:.1f} |"
            )
        lines += [
            "",
            "| task | A vs B | only A right | only B right | exact McNemar p |",
            "|---|---|---|---|---|",
        ]
        for comp in self.comparisons:
            lines.append(
                f"| {comp['task']} | {comp['a']} vs {comp['b']} | {comp['only_a']} | "
                f"{comp['only_b']} | {_format_p(comp['p_value'])} |"
            )
        check = self.checks.get("grammar_eval_correct_when_extracted")
        if check:
            lines += ["", "grammar-eval on items whose span was extracted correctly:"]
            for task, value in check.items():
                lines.append(f"- {task}: {value['correct']} / {value['extracted']} correct")
        return "\n".join(lines)


def _format_p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def summarize(records: Sequence[ItemRecord], config: dict[str, Any]) -> StudySummary:
    """Accuracy table, McNemar comparisons and checks from the per-item records."""
    tasks = list(dict.fromkeys(r.task for r in records))
    modes = [m for m in MODES if any(r.mode == m for r in records)]
    rows = []
    for task in tasks:
        for mode in modes:
            group = [r for r in records if r.task == task and r.mode == mode]
            if not group:
                continue
            tokens = sum(r.n_sampled + r.n_forced for r in group)
            seconds = sum(r.decode_ms for r in group) / 1000
            rows.append(
                {
                    "task": task,
                    "mode": mode,
                    "n": len(group),
                    "correct": sum(r.correct for r in group),
                    "accuracy": sum(r.correct for r in group) / len(group),
                    "wrong_extraction": sum(r.failure == "wrong_extraction" for r in group),
                    "wrong_computation": sum(r.failure == "wrong_computation" for r in group),
                    "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                    "mean_decode_ms": sum(r.decode_ms for r in group) / len(group),
                }
            )
    comparisons = []
    for task in tasks:
        by_mode = {
            mode: {r.item_id: r.correct for r in records if r.task == task and r.mode == mode}
            for mode in modes
        }
        for i, a in enumerate(modes):
            for b in modes[i + 1 :]:
                shared = sorted(set(by_mode[a]) & set(by_mode[b]))
                only_a = sum(by_mode[a][k] and not by_mode[b][k] for k in shared)
                only_b = sum(by_mode[b][k] and not by_mode[a][k] for k in shared)
                comparisons.append(
                    {
                        "task": task,
                        "a": a,
                        "b": b,
                        "pairs": len(shared),
                        "only_a": only_a,
                        "only_b": only_b,
                        "p_value": mcnemar_exact_p(only_a, only_b),
                    }
                )
    extracted: dict[str, Any] = {}
    for task in tasks:
        group = [
            r for r in records if r.task == task and r.mode == "grammar-eval" and r.extraction_ok
        ]
        if any(r.mode == "grammar-eval" for r in records if r.task == task):
            extracted[task] = {"extracted": len(group), "correct": sum(r.correct for r in group)}
    return StudySummary(
        config=config,
        rows=rows,
        comparisons=comparisons,
        checks={"grammar_eval_correct_when_extracted": extracted},
    )


def _plot(summary: StudySummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in summary.rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.2), squeeze=False)
    parts = (
        ("correct", "#2e7d32"),
        ("wrong_extraction", "#f9a825"),
        ("wrong_computation", "#c62828"),
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = [row for row in summary.rows if row["task"] == task]
        labels = [row["mode"] for row in rows]
        bottom = [0.0] * len(rows)
        for key, colour in parts:
            heights = [row[key] / row["n"] * 100 for row in rows]
            ax.bar(labels, heights, bottom=bottom, color=colour, label=key.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, row in enumerate(rows):
            ax.text(
                x,
                row["accuracy"] * 100 / 2,
                f"{row['accuracy'] * 100:.0f}%",
                ha="center",
                va="center",
                color="white",
                fontsize=10,
                fontweight="bold",
            )
        ax.set_title(f"{task} (n = {rows[0]['n']})")
        ax.set_ylabel("% of items")
        ax.set_ylim(0, 100)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    backend = summary.config.get("backend", "")
    fig.suptitle(f"SmolLM2-135M-Instruct, greedy, {backend} backend: answer outcome by mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_study(
    engine: Any,
    config: StudyConfig,
    *,
    evaluator_mode: str = "",
    on_record: Callable[[ItemRecord], None] | None = None,
) -> StudySummary:
    """Runs every (item, mode), writes the results under ``config.out_dir`` and returns the
    summary.

    Files: ``records.jsonl`` (one :class:`ItemRecord` per line, written as the study goes),
    ``summary.json``, ``table.md`` and ``study.png`` (unless ``config.plot`` is false).

    Parameters:
        engine: a :class:`~engine_adapter.LocalEngine` whose evaluators include ``calc`` and
            ``strop`` and which has an evaluator (``grammar-eval`` needs one).
    """
    per_task = [
        (arithmetic_items if task == "arithmetic" else letter_items)(
            config.items_per_task, config.seed
        )
        for task in config.tasks
    ]
    # Tasks interleaved, so that an interrupted run has covered every task equally.
    items = [item for group in zip(*per_task, strict=True) for item in group]
    config.out_dir.mkdir(parents=True, exist_ok=True)
    records_path = config.out_dir / "records.jsonl"
    records: list[ItemRecord] = []
    grammars = {
        (task, mode): engine.span_grammar(
            mode,
            TASK_PREFIX[task],
            content_grammars=(
                {TASK_EVALUATOR[task]: TASK_CONTENT_GRAMMAR[task]}
                if task in TASK_CONTENT_GRAMMAR
                else None
            ),
        )
        for task in config.tasks
        for mode in config.modes
        if mode != "no-grammar"
    }
    evaluator_mode = evaluator_mode or type(engine.evaluator).__name__
    total = len(items) * len(config.modes)
    progress, task_id = _progress(config.progress, total)
    started = time.perf_counter()

    def meta(*, partial: bool) -> dict[str, Any]:
        return {
            "items_per_task": config.items_per_task,
            "seed": config.seed,
            "tasks": list(config.tasks),
            "modes": list(config.modes),
            "backend": engine.backend.name,
            "evaluator_mode": evaluator_mode,
            "prefixes": {task: TASK_PREFIX[task] for task in config.tasks},
            "content_grammars": {
                t: g for t, g in TASK_CONTENT_GRAMMAR.items() if t in config.tasks
            },
            "decoding": "greedy",
            "free_max_new_tokens": config.free_max_new_tokens,
            "grammar_max_new_tokens": config.grammar_max_new_tokens,
            "wall_s": round(time.perf_counter() - started, 1),
            "partial": partial,
        }

    try:
        done = _resumable(records_path, items, config.modes) if config.resume else {}
        with records_path.open("w", encoding="utf-8") as sink:
            for item in items:
                for mode in config.modes:
                    kept = done.get((item.task, item.item_id, mode))
                    if kept is not None:
                        records.append(kept)
                        sink.write(json.dumps(asdict(kept), ensure_ascii=False) + "\n")
                        if progress is not None:
                            progress.advance(task_id)
                        continue
                    grammar = mode != "no-grammar"
                    prefix = TASK_PREFIX[item.task] if grammar else ""
                    result = engine.generate(
                        item.prompt,
                        mode=mode,
                        prefix=prefix,
                        max_new_tokens=(
                            config.grammar_max_new_tokens if grammar else config.free_max_new_tokens
                        ),
                        stop=_STOP if grammar else (),
                        grammar=grammars.get((item.task, mode)),
                    )
                    verdict = classify(item, mode, result.text)
                    record = ItemRecord(
                        task=item.task,
                        item_id=item.item_id,
                        mode=mode,
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
                        evaluator_mode=evaluator_mode,
                        params=item.params,
                        **verdict,
                    )
                    records.append(record)
                    sink.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
                    sink.flush()
                    if on_record is not None:
                        on_record(record)
                    if progress is not None:
                        progress.advance(task_id)
                    if len(records) % _PARTIAL_EVERY == 0:
                        _write_summary(summarize(records, meta(partial=True)), config.out_dir)
    finally:
        if progress is not None:
            progress.stop()
    summary = summarize(records, meta(partial=False))
    _write_summary(summary, config.out_dir)
    if config.plot:
        _plot(summary, config.out_dir / "study.png")
    return summary


def _write_summary(summary: StudySummary, out_dir: Path) -> None:
    (out_dir / "summary.json").write_text(
        json.dumps(asdict(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "table.md").write_text(summary.table_markdown() + "\n", encoding="utf-8")


def _resumable(
    path: Path, items: Sequence[StudyItem], modes: Sequence[str]
) -> dict[tuple[str, int, str], ItemRecord]:
    """Records of an earlier run that answer exactly the questions planned now."""
    if not path.exists():
        return {}
    prompts = {(item.task, item.item_id): item.prompt for item in items}
    kept: dict[tuple[str, int, str], ItemRecord] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = ItemRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue  # a line cut short by the interruption
        if record.mode in modes and prompts.get((record.task, record.item_id)) == record.prompt:
            kept[(record.task, record.item_id, record.mode)] = record
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
