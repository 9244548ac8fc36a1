"""What does an injected result cost a real SGLang CPU server? Forwards per result and the time
from a span's close to its result's last token, with the adapter's jump (``jump``: the whole
region in one extend) and without it (``inline``: one forced token per decode step), for both
of SGLang's schedulers.

Each configuration runs ``--alone`` requests one after the other (a request alone on the server:
the server's own forward counters, ``sglang:cuda_graph_passes_total``, count exactly its
forwards) and one round of ``--concurrent`` requests at once (latency under a batch). Every
request writes two spans, ``17 * 23 + 91`` and ``1 / 0``, whose regions are
``<result>482</result>`` (9 tokens) and ``<result_error>division_by_zero</result_error>``
(15 tokens). Latency is read from the stream: the first chunk that holds the span's close, to
the first that holds its region's end. Prints a table, writes ``reports/sglang/jump.json`` and a
plot.

    engine-adapter bench sglang-jump [--alone 5 --concurrent 8]

Needs ``.venv-sglang`` (``make sglang-venv``); starts its own evald and SGLang servers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine_adapter.testing import fixed_tag, spans_in
from engine_adapter.testing.sglang import (
    CONFIG,
    DEADLINE_MS,
    SCHEDULERS,
    TOKEN,
    SglangServer,
    sglang_python,
    start_server,
)

#: Relative to the checkout the command runs in, like every benchmark\'s results.
REPORT_DIR = Path("reports") / "sglang"
MODES = ("inline", "jump")
CONTENTS = ("17 * 23 + 91", "1 / 0")
REGIONS = ("<result>482</result>", "<result_error>division_by_zero</result_error>")


def timed_stream(server: SglangServer, tag: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: its text, and per span the close → region-end time and the number
    of chunks (forwards) in between."""
    params = {"temperature": 0, "max_new_tokens": 120, "structural_tag": json.dumps(tag)}
    request = urllib.request.Request(
        f"{server.url}/generate",
        data=json.dumps({"text": "Compute:", "sampling_params": params, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    chunks: list[tuple[float, str]] = []
    meta: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            chunks.append((time.monotonic(), chunk.get("text", "")))
            meta = chunk.get("meta_info", meta)
    text = chunks[-1][1] if chunks else ""
    spans = []
    search_from = 0
    for content, region in zip(CONTENTS, REGIONS, strict=True):
        close = f"{content}</calc>"
        end_at = text.index(close, search_from) + len(close)
        region_end = end_at + len(region)
        closed = next(i for i, (_, t) in enumerate(chunks) if len(t) >= end_at)
        done = next(i for i, (_, t) in enumerate(chunks) if len(t) >= region_end)
        spans.append(
            {
                "latency_ms": (chunks[done][0] - chunks[closed][0]) * 1e3,
                "forwards": done - closed,
            }
        )
        search_from = region_end
    return {"text": text, "spans": spans, "completion_tokens": meta.get("completion_tokens")}


def measure(server: SglangServer, target: str, *, alone: int, at_once: int) -> dict[str, Any]:
    """Forwards and latencies on ``server`` (whose adapter uses evald at ``target``)."""
    from engine_adapter import list_evaluators

    calc = {s.name: s for s in list_evaluators(target, TOKEN)}["calc"].binding()
    tag = fixed_tag("So ", (calc, CONTENTS[0]), " and ", (calc, CONTENTS[1]), ".")
    timed_stream(server, tag)  # warm: the grammar is compiled and cached
    forwards_per_request = []
    alone_spans: list[dict[str, Any]] = []
    for _ in range(alone):
        before = server.forward_passes()
        result = timed_stream(server, tag)
        after = server.forward_passes()
        assert [s[2] or s[3] for s in spans_in(result["text"])] == ["482", "division_by_zero"]
        forwards_per_request.append(
            (after["prefill"] - before["prefill"]) + (after["decode"] - before["decode"])
        )
        alone_spans.extend(result["spans"])
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        batch = list(pool.map(lambda _: timed_stream(server, tag), range(at_once)))
    batch_spans = [span for result in batch for span in result["spans"]]

    def summary(spans: list[dict[str, Any]], index: int | None = None) -> dict[str, float]:
        chosen = spans if index is None else spans[index :: len(REGIONS)]
        return {
            "latency_ms_median": statistics.median(s["latency_ms"] for s in chosen),
            "forwards_median": statistics.median(s["forwards"] for s in chosen),
        }

    return {
        "scheduler": server.scheduler,
        "forwards_per_request_alone": statistics.median(forwards_per_request),
        "completion_tokens": batch[0]["completion_tokens"],
        "alone": {
            "value": summary(alone_spans, 0),
            "error": summary(alone_spans, 1),
        },
        "concurrent": {
            "requests": at_once,
            "value": summary(batch_spans, 0),
            "error": summary(batch_spans, 1),
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench sglang-jump``."""
    parser.add_argument("--alone", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS))
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--out", type=Path, default=REPORT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    python = sglang_python()
    if python is None:
        print(
            "error: unavailable: the SGLang venv is absent: run `make sglang-venv` first",
            file=sys.stderr,
        )
        return 2
    from evald.testing import DaemonProcess, start_daemon

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="evald-sgl-") as tmp:
        root = Path(tmp)
        daemon: DaemonProcess = start_daemon(root / "evald", CONFIG)
        try:
            for scheduler in args.schedulers:
                for mode in args.modes:
                    env = {
                        "EVALD_TARGET": daemon.target,
                        "EVALD_TOKEN": TOKEN,
                        "EVALD_DEADLINE_MS": str(DEADLINE_MS),
                        "EVALD_SGLANG_SCHEDULING": mode,
                    }
                    server = start_server(
                        python, env, root / f"sglang-{scheduler}-{mode}.log", scheduler=scheduler
                    )
                    try:
                        result = measure(
                            server, daemon.target, alone=args.alone, at_once=args.concurrent
                        )
                    finally:
                        server.stop()
                    result["mode"] = mode
                    results[f"{scheduler}/{mode}"] = result
                    print(
                        f"{scheduler:8} {mode:6}: {result['forwards_per_request_alone']:.0f} "
                        "forwards per request alone; per result (value / error): forwards "
                        f"{result['alone']['value']['forwards_median']:.0f} / "
                        f"{result['alone']['error']['forwards_median']:.0f}, close to last "
                        f"token {result['alone']['value']['latency_ms_median']:.0f} / "
                        f"{result['alone']['error']['latency_ms_median']:.0f} ms alone, "
                        f"{result['concurrent']['value']['latency_ms_median']:.0f} / "
                        f"{result['concurrent']['error']['latency_ms_median']:.0f} ms with "
                        f"{args.concurrent} at once",
                        flush=True,
                    )
        finally:
            daemon.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "jump.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "jump.png")
    return 0


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = list(results)
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    positions = range(len(keys))
    for offset, kind in ((-0.2, "value"), (0.2, "error")):
        left.bar(
            [p + offset for p in positions],
            [results[k]["alone"][kind]["forwards_median"] for k in keys],
            width=0.4,
            label=f"{kind} region",
        )
        right.bar(
            [p + offset for p in positions],
            [results[k]["concurrent"][kind]["latency_ms_median"] for k in keys],
            width=0.4,
            label=f"{kind} region",
        )
    for axis, title in ((left, "forwards per result (alone)"), (right, "")):
        axis.set_xticks(list(positions), keys, rotation=20, fontsize=8)
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
    at_once = results[keys[0]]["concurrent"]["requests"]
    right.set_title(f"close → last token, ms ({at_once} at once)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
