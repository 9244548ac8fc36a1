"""The ``engine-adapter`` command line: run the local CPU engine, and the accuracy study.

``engine-adapter generate [--evald ADDR] [--token TOKEN] [--mode MODE] [--prefix TEXT]
[--max-new-tokens N] PROMPT`` prints the answer (injected spans included) on stdout as it is
generated; scripts rely on that contract. Diagnostics and timings go to stderr.

Exit statuses: 0 success; 2 a bad request (unknown evaluator, a prefix the grammar refuses, a
backend that is not installed) with ``error: message`` on stderr. An unreachable daemon is not an
error: the answer is still produced, with ``<result_error>unavailable</result_error>`` spans.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]

EXIT_OK = 0
EXIT_ERROR = 2

_MODES = ("no-grammar", "grammar-no-eval", "grammar-eval")
_EVALUATOR_MODES = ("evald", "inprocess", "python")
_BACKENDS = ("llama", "hf")
#: Temperature used when ``--seed`` asks for sampling without naming a temperature.
_DEFAULT_SAMPLING_TEMPERATURE = 0.7


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-adapter",
        description=(
            "Run SmolLM2-135M-Instruct on this CPU with evaluated spans: the model writes "
            "<calc>17 * 23 + 91</calc> and the engine forces <result>482</result> from evald."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
        choices=_MODES,
        default="grammar-eval",
        help="grammar-eval (default): the engine forces evaluated results; grammar-no-eval: "
        "the model writes them; no-grammar: free text",
    )
    _add_engine_options(gen)
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
    gen.add_argument(
        "--instructions",
        action="store_true",
        help="add model-facing instructions rendered from the evaluators' manifests (a system "
        "message for a chat model, solved examples for a base model; printed with --timings; "
        "after --system when both are given)",
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

    study = sub.add_parser(
        "study",
        help="Run the accuracy study (three modes on arithmetic and letter counting).",
        description=(
            "The accuracy study: no-grammar, grammar-no-eval and grammar-eval on seeded "
            "arithmetic word problems and letter-counting questions over real words, greedy "
            "decoding. Writes per-item JSONL records, a table with paired McNemar tests and a "
            "plot under --out."
        ),
    )
    _add_engine_options(study, default_evaluator_mode="inprocess")
    study.add_argument(
        "--profile",
        choices=("tiny", "small", "full"),
        default="full",
        help="tiny: 3 items per task (tests); small: 20; full: 200 (default)",
    )
    study.add_argument("--items", type=int, default=None, metavar="N", help="items per task")
    study.add_argument("--seed", type=int, default=20240601, help="seed of the question sampler")
    study.add_argument(
        "--tasks", default="arithmetic,letters", help="comma-separated: arithmetic, letters"
    )
    study.add_argument("--modes", default=",".join(_MODES), help="comma-separated modes")
    study.add_argument(
        "--instructions",
        default="off,on",
        metavar="LIST",
        help="comma-separated: off (no instructions), on (rendered from the manifests); "
        "default both",
    )
    study.add_argument("--out", type=Path, default=Path("reports/study"), help="results folder")
    study.add_argument(
        "--free-max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="token budget of a no-grammar answer (default: the study's FREE_MAX_NEW_TOKENS)",
    )
    study.add_argument(
        "--resume",
        action="store_true",
        help="keep the records an interrupted run left in --out and run only the rest",
    )
    study.add_argument(
        "--summarize-only",
        action="store_true",
        help="load no model: re-score the records in --out, keep the items that ran in every "
        "condition, and rewrite the table, summary and plot",
    )
    study.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    study.add_argument("--quiet", action="store_true", help="no progress bar")

    bench = sub.add_parser(
        "bench",
        help="Benchmark decoding with spans (also `evald bench decode`).",
        description=(
            "decode: tokens/s and added time per span for no evaluation, in-process Python, "
            "in-process WASM and evald (same prompts, same seeds, interleaved); the tool-call "
            "baseline; the batch stall with one span slow up to its deadline. Starts its own "
            "evald daemon. Writes decode.json and decode.png under --out. The GPU variant is "
            "deploy/gpu-check.sh."
        ),
    )
    bench.add_argument("job", choices=("decode",), help="what to measure")
    bench.add_argument(
        "--profile", choices=("tiny", "full"), default="full", help="tiny: for tests"
    )
    bench.add_argument("--out", type=Path, default=Path("reports/bench"), help="results folder")
    bench.add_argument(
        "--parts", default="decode,toolcall,stall", help="comma-separated: decode,toolcall,stall"
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _add_engine_options(
    parser: argparse.ArgumentParser, *, default_evaluator_mode: str = "evald"
) -> None:
    parser.add_argument("--backend", choices=_BACKENDS, default="llama", help="model runtime")
    parser.add_argument(
        "--model",
        choices=("smollm2", "gemma3-270m"),
        default="smollm2",
        help="smollm2: SmolLM2-135M-Instruct (default); gemma3-270m: Gemma 3 270M base "
        "(llama backend; pip install -e '.[study]')",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "evald", None):
        args.evaluator_mode = "evald"
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "study":
            return _study(args)
        if args.command == "bench":
            return _bench(args)
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


def _open_engine(args: argparse.Namespace, *, system: str | None = None) -> tuple[Any, Any]:
    """``(engine, evaluator_setup)``; raises EngineError/BackendError on bad input."""
    from engine_adapter.local import LocalEngine, load_backend, load_tokenizer, open_evaluator

    setup = open_evaluator(
        args.evaluator_mode,
        target=args.evald,
        token=args.token if args.token is not None else os.environ.get("EVALD_TOKEN"),
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
    try:
        engine, setup = _open_engine(args, system=args.system)
    except (EngineError, BackendError, FileNotFoundError) as exc:
        return _fail(str(exc))
    if args.instructions:
        from engine_adapter._instructions import render_instructions

        text = render_instructions(
            engine.evaluators, style="system" if engine.chat else "few-shot"
        )
        engine.system_prompt = f"{args.system}\n\n{text}" if args.system else text
        if args.timings:
            print(f"instructions:\n{text}", file=sys.stderr)
    out = sys.stdout

    def stream(text: str, forced: bool) -> None:
        out.write(text)
        out.flush()

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
        )
    except EngineError as exc:
        return _fail(str(exc))
    finally:
        setup.close()
        engine.close()
    out.write("\n")
    out.flush()
    if args.timings:
        print(format_timings(result), file=sys.stderr)
    if args.json_path is not None:
        payload = json.dumps(result.to_dict(with_steps=True), indent=2)
        if str(args.json_path) == "-":
            print(payload, file=sys.stderr)
        else:
            args.json_path.write_text(payload + "\n")
    return EXIT_OK


def format_timings(result: Any) -> str:
    """A few human lines: each span with its injected result, then the step timings."""
    lines = []
    for span in result.spans:
        outcome = span.forced_text or "(written by the model)"
        lines.append(
            f"span <{span.evaluator}>{span.content!r} -> {outcome}  "
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


def _study(args: argparse.Namespace) -> int:
    from engine_adapter._study import PROFILES, StudyConfig, resummarize, run_study

    if args.summarize_only:
        try:
            summary = resummarize(args.out, plot=not args.no_plot)
        except FileNotFoundError as exc:
            return _fail(f"no study records to summarize: {exc}")
        print(summary.table_markdown())
        return EXIT_OK

    items = args.items if args.items is not None else PROFILES[args.profile]
    tasks = _names(args.tasks) or []
    modes = _names(args.modes) or []
    flags = _names(args.instructions) or []
    if any(flag not in ("off", "on") for flag in flags):
        return _fail(f"--instructions takes off, on or off,on, not {args.instructions!r}")
    try:
        config = StudyConfig(
            items_per_task=items,
            seed=args.seed,
            tasks=tuple(tasks),
            modes=tuple(modes),
            instructions=tuple(flag == "on" for flag in flags),
            model=args.model,
            out_dir=args.out,
            plot=not args.no_plot,
            **(
                {"free_max_new_tokens": args.free_max_new_tokens}
                if args.free_max_new_tokens is not None
                else {}
            ),
            resume=args.resume,
            progress=not args.quiet,
        )
    except ValueError as exc:
        return _fail(str(exc))
    from engine_adapter.local import BackendError, EngineError

    try:
        engine, setup = _open_engine(args)
    except (EngineError, BackendError, FileNotFoundError) as exc:
        return _fail(str(exc))
    try:
        summary = run_study(engine, config, evaluator_mode=args.evaluator_mode)
    except (EngineError, ValueError) as exc:
        return _fail(str(exc))
    finally:
        setup.close()
        engine.close()
    print(summary.table_markdown())
    print(f"\nrecords, table and plot in {config.out_dir}", file=sys.stderr)
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from engine_adapter._bench_decode import run_decode
    from engine_adapter.local import BackendError

    parts = _names(args.parts) or []
    unknown = [part for part in parts if part not in ("decode", "toolcall", "stall")]
    if unknown or not parts:
        return _fail(f"unknown --parts {unknown}; choose from decode, toolcall, stall")
    try:
        run_decode(
            args.profile,
            out_dir=args.out,
            show_progress=not args.quiet,
            plot=not args.no_plot,
            parts=parts,
        )
    except (BackendError, RuntimeError, OSError) as exc:
        return _fail(str(exc))
    print(f"results in {args.out}/decode.json", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
