"""``python -m evald_lab.demo`` (what ``make run`` shows): the daemon end to end on this machine.

Starts ``evald serve`` with the packaged default config on a temporary unix socket, waits until
it is healthy, runs a few evaluations through ``evald call`` exactly as a person or a script
would, prints them in a table, and stops the daemon with SIGTERM (a graceful drain).

Each part of the demo is a *section*: a function ``(target, console) -> None`` run while the
daemon serves. Later parts (the model demo) append theirs to :data:`SECTIONS`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from evald.client import Client
from evald.daemon import DEFAULT_CONFIG_PATH
from evald.testing import DaemonProcess, evald_command, start_daemon

__all__ = [
    "BEST_CONFIGURATION",
    "ENGINE_PROMPTS",
    "EXAMPLES",
    "SECTIONS",
    "DemoConfiguration",
    "evald_command",
    "main",
    "running_daemon",
    "show_evaluations",
    "show_local_engine",
    "study_rates",
]

#: (evaluator, span content) pairs; an evaluator the daemon does not serve is skipped.
EXAMPLES: tuple[tuple[str, str], ...] = (
    ("calc", "17 * 23 + 91"),
    ("calc", "(2 ** 64) / 3"),
    ("strop", 'count("strawberry", "r")'),
    ("date", "2024-02-28 + 2 days"),
    ("units", "12.5 km to mi"),
    ("checksum", 'crc32("hello")'),
    ("calc", "1 / 0"),
)

Section = Callable[[str, Console], None]


@contextmanager
def running_daemon(workdir: Path, console: Console) -> Iterator[str]:
    """Runs ``evald serve`` (default config) on a socket in ``workdir``; yields its target.

    The daemon is started the way every tool here starts one (:func:`start_daemon`), so it
    dies with the demo however the demo dies.
    """
    console.print(
        f"[bold]starting[/] evald serve --config {DEFAULT_CONFIG_PATH.name} "
        f"--listen unix:{workdir / 'evald.sock'} --state-dir {workdir / 'state'}"
    )
    started = time.perf_counter()
    daemon: DaemonProcess = start_daemon(workdir, DEFAULT_CONFIG_PATH.read_text())
    try:
        console.print(
            f"[green]serving[/] on {daemon.target} after {time.perf_counter() - started:.1f} s "
            f"(pid {daemon.pid}; JSON log in {daemon.log_path.name})"
        )
        yield daemon.target
    finally:
        if daemon.alive():
            try:
                status = daemon.stop(signal.SIGTERM, timeout_s=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                status = daemon.process.returncode
            console.print(f"[bold]stopped[/] the daemon with SIGTERM (exit status {status})")


def _fits(console: Console, table: Table) -> bool:
    """Whether ``table`` prints at ``console``'s width without folding a cell (a console that
    is not a terminal is 80 columns wide, or ``$COLUMNS``)."""
    unbounded = console.options.update_width(1 << 16)  # a measure is clamped to the width
    needed = Measurement.get(console, unbounded, table).maximum
    return needed <= console.width


@dataclass(frozen=True)
class _Row:
    evaluator: str
    content: str
    status: int
    output: str
    wall_ms: float


def show_evaluations(target: str, console: Console) -> None:
    """Runs :data:`EXAMPLES` through ``evald call`` and prints what each printed and took."""
    with Client(target) as client:
        served = {info.name for info in client.list_evaluators()}
    console.print(f"evaluators served: {', '.join(sorted(served)) or '(none)'}")
    examples = [(name, content) for name, content in EXAMPLES if name in served]
    skipped = sorted({name for name, _ in EXAMPLES} - served)
    rows: list[_Row] = []
    env = {**os.environ, "EVALD_TARGET": target}
    for name, content in examples:
        started = time.perf_counter()
        result = subprocess.run(
            [*evald_command(), "call", name, "--", content],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        wall_ms = (time.perf_counter() - started) * 1000
        output = (result.stdout if result.returncode == 0 else result.stderr).strip()
        rows.append(_Row(name, content, result.returncode, output, wall_ms))
    with Client(target) as client:
        client.evaluate_batch(examples)  # warm: each worker thread instantiates once
        inside = client.evaluate_batch(examples)
    table = Table(title="evald call TAG INPUT", box=box.SIMPLE_HEAD)
    for column in ("span", "printed", "exit", "evald call ms", "in daemon µs (warm)", "fuel"):
        table.add_column(column, no_wrap=True)
    for row, response in zip(rows, inside, strict=True):
        style = "green" if row.status == 0 else "yellow"
        table.add_row(
            f"<{row.evaluator}>{escape(row.content)}</{row.evaluator}>",
            f"[{style}]{escape(row.output)}[/]",
            str(row.status),
            f"{row.wall_ms:.0f}",
            str(response.eval_time_us),
            str(response.fuel_used),
        )
    if _fits(console, table):
        console.print(table)
    else:  # a log, CI, a narrow window: one entry per span, no box to cut
        console.print("[bold]evald call TAG INPUT[/]")
        for row, response in zip(rows, inside, strict=True):
            style = "green" if row.status == 0 else "yellow"
            console.print(f"  <{row.evaluator}>{escape(row.content)}</{row.evaluator}>")
            console.print(f"    -> [{style}]{escape(row.output)}[/]", overflow="fold")
            console.print(
                f"    [dim]exit {row.status}, evald call {row.wall_ms:.0f} ms, in daemon "
                f"{response.eval_time_us} µs (warm), fuel {response.fuel_used}[/]"
            )
    console.print(
        "[dim]`evald call ms` includes starting the CLI process; `in daemon µs` is the "
        "evaluation alone as the daemon reports it, on an already instantiated module.[/]"
    )
    if skipped:
        console.print(f"[dim]skipped (not built): {', '.join(skipped)}[/]")


# ---------------------------------------------------------------------------------------------
# The local engine end to end: SmolLM2-135M on this CPU writes spans, evald answers, the engine
# forces the results through the model. Heavy imports stay inside the function.


@dataclass(frozen=True)
class DemoConfiguration:
    """How the demo asks the model: the configuration the accuracy study found best."""

    instructions: bool
    """Model-facing instructions rendered from the manifests, as a system message."""
    operands: bool
    """Operands from the context: the span's literals must be the question's."""
    mode: str
    study: str
    """Where the study says so (the held-out set's summary) and what it measured."""

    def describe(self) -> str:
        parts = [self.mode]
        if self.instructions:
            parts.append("instructions from the manifests")
        if self.operands:
            parts.append("operands from the question")
        return " + ".join(parts)


#: The accuracy study's best arm for SmolLM2 on the held-out problems (README, "The local engine
#: and the accuracy study"); tests/lab/test_demo.py checks it against the committed summary.
BEST_CONFIGURATION = DemoConfiguration(
    instructions=True,
    operands=True,
    mode="grammar-eval",
    study="reports/study/heldout/smollm2/summary.json",
)

#: (title, prompt, forced prefix, a span that sets the question up right, for the verdict).
ENGINE_PROMPTS: tuple[tuple[str, str, str, tuple[str, str]], ...] = (
    (
        "arithmetic word problem",
        "A box has 17 rows of 23 items, then 91 more are added. How many items are in the box?",
        "The expression is <calc>",
        ("calc", "17 * 23 + 91"),
    ),
    (
        "letter counting",
        "How many r's are in strawberry?",
        "The expression is <strop>",
        ("strop", 'count("strawberry", "r")'),
    ),
    (
        "a date question",
        "Which day of the week was 2024-07-04?",
        "The expression is <date>",
        ("date", "weekday(2024-07-04)"),
    ),
)


_STOP_AFTER_RESULT = ("</result>", "</result_error>")
#: The text before the span in every demo answer (each prompt's prefix is it plus the opener).
_ANSWER_LEAD = "The expression is "


def show_local_engine(target: str, console: Console) -> None:
    """Runs :data:`ENGINE_PROMPTS` on the local engine in :data:`BEST_CONFIGURATION` and says
    for each answer whether it is right (against the value of a span that sets the question up
    right); a wrong answer is shown as it is, with the span the model wrote. Then, for contrast,
    the same request with the model writing the value itself (grammar-no-eval)."""
    from rich.text import Text

    from engine_adapter import EvaluatorClient, list_evaluators, render_instructions
    from engine_adapter.local import BackendError, LocalEngine, load_backend, load_tokenizer

    config = BEST_CONFIGURATION
    console.rule("[bold]the local engine: SmolLM2-135M-Instruct on this CPU, spans via evald")
    started = time.perf_counter()
    try:
        backend = load_backend("llama")
    except BackendError as exc:
        console.print(f"[yellow]{exc}[/]; using the transformers backend")
        backend = load_backend("hf")
    tokenizer = load_tokenizer()
    console.print(
        f"model loaded ({backend.name} backend) in {time.perf_counter() - started:.1f} s; "
        f"greedy decoding; [bold green]green[/] = forced by the engine, [dim]dim[/] = the forced "
        "prefix"
    )
    console.print(
        f"configuration: [bold]{config.describe()}[/] (the accuracy study's best for this "
        f"model, {config.study})"
    )
    try:
        with EvaluatorClient(target) as client, Client(target) as checker:
            client.wait_connected(10.0)
            evaluators = list_evaluators(target)
            # as in the study: the examples' answers open with the forced prefix's lead-in
            system = (
                render_instructions(evaluators, answer_prefix=_ANSWER_LEAD)
                if config.instructions
                else None
            )
            engine = LocalEngine(
                backend, tokenizer, evaluators, evaluator=client, deadline_ms=1000,
                system_prompt=system,
            )
            for title, prompt, prefix, (name, right_span) in ENGINE_PROMPTS:
                console.print(f"\n[bold]{title}[/]: {prompt}")
                expected = checker.evaluate(name, right_span).value
                for mode in (config.mode, "grammar-no-eval"):
                    chunks: list[tuple[str, bool]] = []

                    def collect(
                        text: str, forced: bool, sink: list[tuple[str, bool]] = chunks
                    ) -> None:
                        sink.append((text, forced))

                    result = engine.generate(
                        prompt,
                        mode=mode,
                        prefix=prefix,
                        max_new_tokens=40,
                        stop=_STOP_AFTER_RESULT,
                        on_text=collect,
                        operands_from=True if config.operands else None,
                    )
                    shown = Text(f"  {mode:>15}: ")
                    for index, (text, forced) in enumerate(chunks):
                        style = "dim" if index == 0 and forced else "bold green" if forced else ""
                        shown.append(text, style=style)
                    console.print(shown)
                    if mode == config.mode:
                        _show_verdict(console, result, name, expected, right_span)
                    else:
                        console.print(
                            f"{'':19}[dim](for contrast: the model writes the value itself)[/]"
                        )
    finally:
        backend.close()


#: The study's task for each evaluator the demo asks about (the study asks no date questions).
_STUDY_TASKS = {"calc": "arithmetic", "strop": "letters"}
_TASK_WORDS = {"arithmetic": "arithmetic word problems", "letters": "letter-counting questions"}
_REPOSITORY = Path(__file__).resolve().parents[2]
_VERDICT_INDENT = 19


def study_rates(evaluator: str, configuration: DemoConfiguration = BEST_CONFIGURATION) -> str:
    """What the committed accuracy study measured for the demo's model and configuration on
    ``evaluator``'s task: how often the model sets the span up right, and how many of those
    evald computed right (README, "The local engine and the accuracy study")."""
    from evald_lab.study.run import OPERANDS_ARM

    path = _REPOSITORY / configuration.study
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        return f"(the accuracy study's results, {configuration.study}, are not here)"
    model, tasks = summary["config"]["model_title"], summary["config"]["tasks"]
    task = _STUDY_TASKS.get(evaluator)
    if task is None or task not in tasks:
        return (
            f"measured: the accuracy study asked {model} no {evaluator} questions (only "
            f"{' and '.join(tasks)}), so there is no rate to show for this one"
        )
    arm = OPERANDS_ARM if configuration.operands else configuration.mode
    row = next(
        r for r in summary["rows"]
        if (r["task"], r["mode"], r["instructions"]) == (task, arm, configuration.instructions)
    )  # fmt: skip
    label = f"{task}, {arm}, instructions {'on' if configuration.instructions else 'off'}"
    check = summary["checks"]["grammar_eval_correct_when_extracted"][label]
    computed = (
        f"evald computed every one of those right ({check['correct']} of {check['extracted']})"
        if check["correct"] == check["extracted"]
        else f"evald computed {check['correct']} of those {check['extracted']} right"
    )
    return (
        f"measured for {model} in this configuration, on {row['n']} held-out "
        f"{_TASK_WORDS.get(task, task + ' questions')}: it sets the span up right "
        f"{row['extraction_rate']:.1%} of the time, and "
        f"{computed}; accuracy {row['accuracy']:.1%} ({configuration.study})"
    )


def _print_indented(console: Console, markup: str) -> None:
    """One verdict or note, wrapped under the answer it is about (reads at 80 columns)."""
    from rich.padding import Padding
    from rich.text import Text

    text = Text.from_markup(markup)
    console.print(Padding(text, (0, 0, 0, _VERDICT_INDENT)), highlight=False)


def _show_verdict(
    console: Console, result: Any, evaluator: str, expected: str, right_span: str
) -> None:
    """Right or wrong, against the value of a span that sets the question up right; a wrong
    answer names the span the model wrote and says that evald computed it exactly. Then what
    the study measured for this model on such questions (:func:`study_rates`)."""
    import re

    span = next((s for s in result.spans if s.evaluator == evaluator), None)
    if span is None:
        opened = re.search(rf"<{evaluator}>(.*)$", result.text, re.S)
        written = escape(opened.group(1)) if opened else ""
        _print_indented(
            console,
            f"[red]wrong[/]: the model never closed its span (<{evaluator}>{written}…); "
            f"the answer is {expected}",
        )
    elif span.value == expected:
        _print_indented(
            console,
            f"[green]right[/]: {expected}; evald answered in "
            f"{span.eval_latency_us / 1000:.2f} ms, {span.n_forced_tokens} tokens forced in one "
            f"forward of {span.inject_forward_us / 1000:.1f} ms",
        )
    else:
        outcome = span.value if span.value is not None else f"error {span.error_code}"
        _print_indented(
            console,
            f"[red]wrong[/]: the model wrote <{evaluator}>{escape(span.content)}"
            f"</{evaluator}>, which evald computed exactly ({escape(outcome)}), but it sets up "
            f"another question: the answer is {expected} (<{evaluator}>{escape(right_span)}"
            f"</{evaluator}>)",
        )
    _print_indented(console, f"[dim]{escape(study_rates(evaluator))}[/]")


#: What the demo shows while the daemon serves, in order.
SECTIONS: list[Section] = [show_evaluations]
SECTIONS.append(show_local_engine)


def main() -> int:
    """Runs every section against a fresh daemon; returns the exit status."""
    console = Console()
    with tempfile.TemporaryDirectory(prefix="evald-demo-") as tmp:
        with running_daemon(Path(tmp), console) as target:
            for section in SECTIONS:
                section(target, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
