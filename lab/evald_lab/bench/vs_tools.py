"""Evaluated spans against tool calling, on the real SGLang and vLLM CPU servers, through the
OpenAI-compatible API with the ``openai`` client, as an application would call them.

Same model (SmolLM2-135M-Instruct), same server, same questions ("What is 17 times 23, plus
91?"), the same ``max_tokens`` for every request, greedy:

- ``span``: one streamed chat request whose structural tag opens the answer with a ``<calc>``
  span holding the question's expression (the model writes each token, the grammar allows only
  these); the adapter forces evald's value, the model finishes the answer.
- ``tool``: the same question with ``tools=[calc, strop]`` described from the evaluators'
  manifests (strict, calc's argument fixed to the question's expression by a JSON schema
  ``const``: the call's counterpart of the span's fixed content) and ``tool_choice=
  "required"``. SmolLM2's own template has no tool format; the servers run it extended with
  the Hermes one (``vs_tools_chat_template.jinja``: the tools in the system message,
  ``<tool_call>``, ``<tool_response>``; without tools it renders what the model's template
  renders), and both parse the call with their ``hermes`` tool parser (SGLang streams no
  ``tool_calls`` without a parser, vLLM refuses ``required`` without one); the servers'
  grammar for ``required`` makes the model write the call. The client runs the tool (through
  evald or in-process, whichever the run measured faster), appends the assistant turn and the
  tool message, and streams the second request (same tools, ``tool_choice="auto"``; prefix
  caching on, as the servers ship).

Per path at each concurrency (``--concurrency 1 8 32``; a batch of ``max(c, --answers)``
answers at once): time per answer (p50, p90), time to the value in the stream, answers/s over
the batches' wall time, prompt / cached / completion tokens and requests per answer (the
servers' usage, cached tokens from ``usage.prompt_tokens_details``), the client's time between
the turns; whether each final answer states the value (exact, rounded or reformatted,
different, missing). Rounds alternate the paths' order; ``--hogs 0 2`` runs quiet and beside
two busy-looping processes. Ratios per run: span ÷ tool time per answer at the lowest
concurrency (target <= 0.6), span ÷ tool answers/s at the highest (target >= 1.5).

    engine-adapter bench vs-tools [--servers sglang vllm] [--hogs 0 2] [--rounds 2]

Needs ``.venv-sglang`` / ``.venv-vllm`` (``make sglang-venv`` / ``make vllm-venv``, or
``EVALD_SGLANG_PYTHON`` / ``EVALD_VLLM_PYTHON``); starts its own evald and servers. Writes
``vs_tools.json`` and ``vs_tools.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evald_lab.bench._common import load_average, machine_info, write_json
from evald_lab.bench._vs_tools_paths import (
    Answer,
    Question,
    ToolRun,
    fixed_tools,
    questions,
    span_answer,
    span_tag,
    tool_answer,
    tools_from,
)
from evald_lab.bench._vs_tools_summary import cell_summary, plot, ratios, stated

__all__ = ["add_arguments", "main", "measure"]

REPORT_DIR = Path("reports") / "bench" / "vs_tools"
CHAT_TEMPLATE = Path(__file__).with_name("vs_tools_chat_template.jinja")
SERVERS = ("sglang", "vllm")
EVALUATORS = ("calc", "strop")
#: SGLang's KV cache share of the machine's memory: its test harness's 0.05 is refused when the
#: shared machine has little memory free (the weights leave no room under it).
MEM_FRACTION = "0.1"
#: Tool runs timed per runner before the rounds, to pick the tool path's faster runner.
TOOL_TIMING_CALLS = 30


@dataclass
class Served:
    """A running server as the benchmark uses it."""

    name: str
    url: str
    model: str
    target: str
    token: str
    free_text: dict[str, Any]
    """The standard span grammar's free text (the span path's answer after its span)."""
    stop: Callable[[], None]


def _sglang(root: Path, scheduler: str) -> tuple[Served, Callable[[], object]]:
    from engine_adapter.sglang.request import structural_tag_for
    from engine_adapter.testing.sglang import CONFIG, DEADLINE_MS, TOKEN, sglang_python
    from engine_adapter.testing.sglang import start_server as start_sglang
    from evald.testing import DaemonProcess, start_daemon

    python = sglang_python()
    if python is None:
        raise RuntimeError("the SGLang venv is absent: run `make sglang-venv` first")
    daemon: DaemonProcess = start_daemon(root / "evald-sglang", CONFIG, own_session=True)
    try:
        env = {
            "EVALD_TARGET": daemon.target,
            "EVALD_TOKEN": TOKEN,
            "EVALD_DEADLINE_MS": str(DEADLINE_MS),
        }
        server = start_sglang(
            python,
            env,
            root / "sglang.log",
            scheduler=scheduler,
            extra_args=[
                "--chat-template",
                str(CHAT_TEMPLATE),
                "--enable-cache-report",
                "--tool-call-parser",
                "hermes",
                "--mem-fraction-static",
                MEM_FRACTION,
            ],
        )
    except BaseException:
        daemon.stop()
        raise
    free = structural_tag_for(daemon.target, TOKEN, list(EVALUATORS))["format"]
    served = Served("sglang", server.url, server.model, daemon.target, TOKEN, free, server.stop)
    return served, daemon.stop


def _vllm(root: Path) -> tuple[Served, Callable[[], object]]:
    from engine_adapter.testing.vllm import CONFIG, DEADLINE_MS, TOKEN, vllm_python
    from engine_adapter.testing.vllm import start_server as start_vllm
    from engine_adapter.vllm.request import evaluated_request
    from evald.testing import DaemonProcess, start_daemon

    python = vllm_python()
    if python is None:
        raise RuntimeError("the vLLM venv is absent: run `make vllm-venv` first")
    daemon: DaemonProcess = start_daemon(root / "evald-vllm", CONFIG, own_session=True)
    try:
        env = {
            "EVALD_TARGET": daemon.target,
            "EVALD_TOKEN": TOKEN,
            "EVALD_DEADLINE_MS": str(DEADLINE_MS),
        }
        server = start_vllm(
            python,
            env,
            root / "vllm.log",
            args=[
                "--chat-template",
                str(CHAT_TEMPLATE),
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--tool-call-parser",
                "hermes",
                "--enable-auto-tool-choice",
            ],
        )
    except BaseException:
        daemon.stop()
        raise
    free = evaluated_request(daemon.target, TOKEN, list(EVALUATORS)).structural_tag["format"]
    served = Served("vllm", server.url, server.model, daemon.target, TOKEN, free, server.stop)
    return served, daemon.stop


@contextlib.contextmanager
def serving(name: str, root: Path, scheduler: str) -> Iterator[Served]:
    """``name``'s server with the adapter and its own evald, for the block."""
    served, stop_daemon = _sglang(root, scheduler) if name == "sglang" else _vllm(root)
    try:
        yield served
    finally:
        try:
            served.stop()
        finally:
            stop_daemon()


@contextlib.contextmanager
def tool_runners(target: str, token: str) -> Iterator[dict[str, ToolRun]]:
    """The two ways the client runs a tool: evald over its socket (one client, kept open) and
    evald's WASM host in the client's own process."""
    from engine_adapter import InProcessWasmEvaluator
    from evald.client import Client
    from evald.contract import ErrorCode

    client = Client(target, token)
    local = InProcessWasmEvaluator()

    def through_evald(name: str, expression: str) -> tuple[str | None, str | None]:
        response = client.evaluate(name, expression)
        if response.WhichOneof("outcome") == "value":
            return str(response.value), None
        return None, ErrorCode.from_proto(response.error.code).value

    def in_process(name: str, expression: str) -> tuple[str | None, str | None]:
        result = local.submit(name, expression, 5000).result()
        return result.value, result.error_code

    try:
        yield {
            "evald": ToolRun("evald", through_evald),
            "inprocess": ToolRun("inprocess", in_process),
        }
    finally:
        local.close()
        client.close()


def time_tools(runners: dict[str, ToolRun], asked: Sequence[Question]) -> dict[str, Any]:
    """Each runner's time per tool run (p50, µs) on the questions' expressions, alternating."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(TOOL_TIMING_CALLS):
        expression = asked[i % len(asked)].expression
        for runner in runners.values():
            start = time.perf_counter()
            runner.run("calc", expression)
            samples[runner.name].append(time.perf_counter() - start)
    p50 = {name: round(sorted(s)[len(s) // 2] * 1e6, 1) for name, s in samples.items()}
    return {"p50_us": p50, "faster": min(p50, key=lambda name: p50[name])}


def _batch(
    call: Callable[[Question], Answer], asked: Sequence[Question], concurrency: int
) -> tuple[list[Answer], float]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(call, asked))
    return answers, time.perf_counter() - start


def measure(
    served: Served,
    tool: ToolRun,
    *,
    concurrency: Sequence[int],
    rounds: int,
    answers: int,
    max_tokens: int,
    warmup: int,
    asked: Iterator[Question],
) -> dict[str, Any]:
    """The alternating rounds on one server; the cells, the ratios and every answer."""
    from openai import OpenAI

    specs = _specs(served)
    tools = tools_from(specs[name] for name in EVALUATORS)
    calc = specs["calc"].binding()
    client = OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=900)

    def run_span(question: Question) -> Answer:
        tag = span_tag(calc, question.expression, served.free_text)
        done = span_answer(client, served.model, question, tag, max_tokens)
        # What the answer must state: evald's value for the span's content, asked apart from
        # the server after the answer's own time (in the batch's wall time: well under 1 ms).
        done.extra["forced"] = done.value
        done.value = None if done.expression is None else tool.run("calc", done.expression)[0]
        return done

    def run_tool(question: Question) -> Answer:
        fixed = fixed_tools(tools, "calc", question.expression)
        return tool_answer(client, served.model, question, fixed, tool, max_tokens)

    paths = {"span": run_span, "tool": run_tool}
    for _ in range(warmup):  # the server warm, the tools' prefix cached: tool calling's best case
        question = next(asked)
        for call in paths.values():
            call(question)
    kept: dict[str, dict[int, list[Answer]]] = {p: {c: [] for c in concurrency} for p in paths}
    walls: dict[str, dict[int, float]] = {p: dict.fromkeys(concurrency, 0.0) for p in paths}
    for round_index in range(rounds):
        order = list(paths) if round_index % 2 == 0 else list(reversed(paths))
        for level in concurrency:
            batch = [next(asked) for _ in range(max(level, answers))]
            for name in order:
                done, wall = _batch(paths[name], batch, level)
                kept[name][level] += done
                walls[name][level] += wall
    cells = {
        name: {str(c): cell_summary(kept[name][c], walls[name][c]) for c in concurrency}
        for name in paths
    }
    return {
        "cells": cells,
        "ratios": ratios(cells),
        "answers": [_record(a, c) for name in paths for c in concurrency for a in kept[name][c]],
    }


def _specs(served: Served) -> dict[str, Any]:
    from engine_adapter import list_evaluators

    return {spec.name: spec for spec in list_evaluators(served.target, served.token)}


def _record(answer: Answer, concurrency: int) -> dict[str, Any]:
    return {
        "path": answer.path,
        "concurrency": concurrency,
        "question": answer.question.text,
        "expression_asked": answer.question.expression,
        "expression": answer.expression,
        "value": answer.value,
        "stated": stated(answer),
        "e2e_ms": round(answer.e2e_s * 1000, 1),
        "value_in_stream_ms": None
        if answer.value_in_stream_s is None
        else round(answer.value_in_stream_s * 1000, 1),
        "text": answer.text[:300],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench vs-tools``."""
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per setting (alternating)")
    parser.add_argument(
        "--answers",
        type=int,
        default=4,
        help="answers per batch at least (a batch at concurrency c: max(c, N))",
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request")
    parser.add_argument("--warmup", type=int, default=2, help="answers per path before measuring")
    parser.add_argument(
        "--hogs",
        nargs="+",
        type=int,
        default=[0, 2],
        help="busy-looping processes beside the run (one run per count)",
    )
    parser.add_argument(
        "--tool-runner",
        choices=("faster", "evald", "inprocess"),
        default="faster",
        help="how the client runs the tool (faster: as timed)",
    )
    parser.add_argument(
        "--scheduler",
        choices=("normal", "overlap"),
        default="overlap",
        help="SGLang's scheduler (overlap: SGLang's default)",
    )
    parser.add_argument("--out", type=Path, default=REPORT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    if min(args.concurrency) < 1 or args.rounds < 1 or args.answers < 1 or args.max_tokens < 8:
        print(
            "error: invalid_argument: concurrency, rounds and answers must be >= 1, "
            "--max-tokens >= 8",
            file=sys.stderr,
        )
        return 2
    document: dict[str, Any] = {
        "benchmark": "vs-tools",
        "machine": machine_info(),
        "settings": _settings(args),
        "runs": {},
    }
    asked = iter(questions(10_000))
    try:
        with tempfile.TemporaryDirectory(prefix="evald-vs-tools-") as tmp:
            for name in args.servers:
                _run_server(name, Path(tmp), args, document, asked)
    except (RuntimeError, OSError, ImportError) as exc:
        print(f"error: unavailable: {' '.join(str(exc).split())[:2000]}", file=sys.stderr)
        return 2
    print(f"results in {args.out}/vs_tools.json", file=sys.stderr)
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "servers": args.servers,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "answers_per_batch_at_least": args.answers,
        "max_tokens": args.max_tokens,
        "warmup": args.warmup,
        "hogs": args.hogs,
        "sglang_scheduler": args.scheduler,
        "evaluators": list(EVALUATORS),
        "tool_choice_first_turn": "required",
        "tool_parser": "hermes",
        "span_content_and_tool_argument": "the question's expression, fixed by the grammar",
        "chat_template": CHAT_TEMPLATE.name,
    }


def _run_server(
    name: str,
    root: Path,
    args: argparse.Namespace,
    document: dict[str, Any],
    asked: Iterator[Question],
) -> None:
    from evald.testing import cpu_hogs

    with (
        serving(name, root, args.scheduler) as served,
        tool_runners(served.target, served.token) as runners,
    ):
        timing = time_tools(runners, [next(asked) for _ in range(8)])
        chosen = timing["faster"] if args.tool_runner == "faster" else args.tool_runner
        for count in args.hogs:
            key = f"{name}/{'quiet' if not count else f'{count} hogs'}"
            load_before = load_average()
            with cpu_hogs(count):
                result = measure(
                    served,
                    runners[chosen],
                    concurrency=args.concurrency,
                    rounds=args.rounds,
                    answers=args.answers,
                    max_tokens=args.max_tokens,
                    warmup=args.warmup,
                    asked=asked,
                )
            result.update(
                server=name,
                hogs=count,
                tool_runner=chosen,
                tool_timing=timing,
                load_average_before=load_before,
                load_average_after=load_average(),
            )
            document["runs"][key] = result
            _print_run(key, result)
            write_json(args.out / "vs_tools.json", document)  # a cut-short run keeps its part
            plot(document["runs"], args.out / "vs_tools.png")


def _print_run(key: str, result: dict[str, Any]) -> None:
    for path_name, cells in result["cells"].items():
        for level, cell in cells.items():
            print(
                f"{key} {path_name:4} c={level:>2}: e2e p50 {cell['e2e']['p50_ms']} ms "
                f"p90 {cell['e2e']['p90_ms']} ms, value at {cell['value_in_stream']['p50_ms']} "
                f"ms, {cell['answers_per_s']} answers/s, tokens prompt "
                f"{cell['prompt_tokens_per_answer']} cached {cell['cached_tokens_per_answer']} "
                f"completion {cell['completion_tokens_per_answer']}, stated {cell['stated']}"
            )
    print(f"{key} ratios: {result['ratios']}")
