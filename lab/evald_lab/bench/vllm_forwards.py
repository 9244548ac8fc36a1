"""What does an injected result cost a real vLLM CPU server? Forwards per result, the time from a
span's close to its region's last token, and whether a pending span holds back the rest of the
batch, for the ways the adapter forces a region, side by side in one run:

- ``per-token``: vLLM without speculative decoding, one forced token per engine step (before);
- ``drafts``: ``--speculative-config`` with the adapter's own proposer
  (``engine_adapter.vllm.proposer``): the whole region goes through vLLM's verify step as draft
  tokens in one forward (after);
- ``ngram``: vLLM's n-gram proposer drafting for every request, the adapter's regions among them.

One evald and one server per configuration run at once; rounds alternate between them, so every
configuration sees the same machine. Each round: a request alone per server (forwards read from
the server's own counters: engine steps, ``vllm:iteration_tokens_total_count``, and verify
forwards, ``vllm:spec_decode_num_drafts_total``), then ``--concurrent`` requests at once (the
latency under a batch). Every request writes two spans, ``17 * 23 + 91`` and ``1 / 0``, whose
regions are ``<result>482</result>`` (9 tokens) and
``<result_error>division_by_zero</result_error>`` (15 tokens). Latency is read from the stream:
the chunk that holds the span's close to the one that holds its region's end. Then the stall
benchmark (:func:`evald_lab.bench.vllm_stall.measure_stall`: plain streamed requests next to
spans an evaluator spins on until their deadline, against the same next to calc) runs one round
per configuration in turn. Prints a table, writes ``forwards.json`` and ``forwards.png``.

    engine-adapter bench vllm-forwards [--rounds 3 --concurrent 8 --stall-rounds 4]

Needs ``.venv-vllm`` (``make vllm-venv``); starts its own evald and vLLM servers.
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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from engine_adapter.testing.vllm import (
    CONFIG,
    DEADLINE_MS,
    TOKEN,
    VllmServer,
    fixed_tag,
    start_server,
    vllm_python,
)
from evald_lab.bench.vllm_stall import measure_stall

__all__ = ["CONFIGS", "add_arguments", "main", "measure_round", "timed_stream"]

#: Relative to the checkout the command runs in, like every benchmark's results.
REPORT_DIR = Path("reports") / "vllm"
CONTENTS = ("17 * 23 + 91", "1 / 0")
#: The stall benchmark's arms measured per configuration: next to spinning spans and fast ones.
STALL_ARMS = ("fast", "spinning")
REGIONS = ("<result>482</result>", "<result_error>division_by_zero</result_error>")
#: ``--speculative-config`` of each configuration (``None``: without speculative decoding).
CONFIGS: dict[str, dict[str, Any] | None] = {
    "per-token": None,
    "drafts": {
        "method": "custom_class",
        "model": "engine_adapter.vllm.proposer.ForcedOnlyProposer",
        "num_speculative_tokens": 16,
    },
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    },
}


def timed_stream(server: VllmServer, tag: dict[str, Any], token: str) -> dict[str, Any]:
    """One streamed completion: its text, and per span the close → region-end time and the
    number of chunks (engine steps) in between."""
    payload = {
        "model": server.model,
        "prompt": "Compute:",
        "temperature": 0,
        "max_tokens": 120,
        "stream": True,
        "structured_outputs": {"structural_tag": json.dumps(tag)},
        "vllm_xargs": {"evald_token": token},
    }
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"content-type": "application/json"},
    )
    chunks: list[tuple[float, int]] = []  # (arrival, length of the text so far)
    text = ""
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            piece = json.loads(line[5:])["choices"][0].get("text", "")
            if piece:
                text += piece
                chunks.append((time.monotonic(), len(text)))
    spans = []
    search_from = 0
    for content, region in zip(CONTENTS, REGIONS, strict=True):
        close = f"{content}</calc>"
        end_at = text.index(close, search_from) + len(close)
        region_end = end_at + len(region)
        if text[end_at:region_end] != region:
            raise RuntimeError(f"expected {region!r} after the span: {text!r}")
        closed = next(i for i, (_, n) in enumerate(chunks) if n >= end_at)
        done = next(i for i, (_, n) in enumerate(chunks) if n >= region_end)
        spans.append(
            {"latency_ms": (chunks[done][0] - chunks[closed][0]) * 1e3, "steps": done - closed}
        )
        search_from = region_end
    return {"text": text, "spans": spans}


_COUNTERS = (
    "iteration_tokens_total_count",
    "generation_tokens_total",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


def measure_round(
    server: VllmServer, tag: dict[str, Any], token: str, concurrent_n: int
) -> dict[str, Any]:
    """One request alone (with the server's counters around it), then ``concurrent_n`` at once."""
    before = server.counters()
    alone = timed_stream(server, tag, token)
    after = server.counters()
    counters = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in _COUNTERS}
    with concurrent.futures.ThreadPoolExecutor(concurrent_n) as pool:
        batch = list(pool.map(lambda _: timed_stream(server, tag, token), range(concurrent_n)))
    return {"alone": alone, "counters": counters, "batch": batch}


@contextmanager
def _servers(
    python: Path, names: list[str], target: str, root: Path
) -> Iterator[dict[str, VllmServer]]:
    env = {"EVALD_TARGET": target, "EVALD_TOKEN": TOKEN, "EVALD_DEADLINE_MS": str(DEADLINE_MS)}
    with ExitStack() as stack:
        servers = {}
        for name in names:
            spec = CONFIGS[name]
            args = ("--speculative-config", json.dumps(spec)) if spec else ()
            server = start_server(python, env, root / f"vllm-{name}.log", args=args)
            stack.callback(server.stop)
            servers[name] = server
            print(f"{name}: server ready", flush=True)
        yield servers


def _summary(spans: list[dict[str, Any]], index: int) -> dict[str, float]:
    chosen = spans[index :: len(REGIONS)]
    return {
        "latency_ms_median": statistics.median(s["latency_ms"] for s in chosen),
        "steps_median": statistics.median(s["steps"] for s in chosen),
    }


def run(
    python: Path, names: list[str], rounds: int, concurrent_n: int, stall_rounds: int
) -> dict[str, Any]:
    """Starts evald and the servers, alternates the rounds, returns the results."""
    from engine_adapter import list_evaluators
    from evald.testing import DaemonProcess, start_daemon

    with tempfile.TemporaryDirectory(prefix="evald-vllm-") as tmp:
        root = Path(tmp)
        daemon: DaemonProcess = start_daemon(root / "evald", CONFIG)
        try:
            calc = {s.name: s for s in list_evaluators(daemon.target, TOKEN)}["calc"].binding()
            tag = fixed_tag("So ", (calc, CONTENTS[0]), " and ", (calc, CONTENTS[1]), ".")
            with _servers(python, names, daemon.target, root) as servers:
                for server in servers.values():
                    timed_stream(server, tag, TOKEN)  # warm: the grammar is compiled
                raw: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
                for number in range(rounds):
                    for name in names:
                        raw[name].append(measure_round(servers[name], tag, TOKEN, concurrent_n))
                    print(f"round {number + 1}/{rounds} done", flush=True)
                stall: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
                for number in range(stall_rounds):
                    for name in names:
                        stall[name].append(
                            measure_stall(servers[name], daemon.target, rounds=1, arms=STALL_ARMS)
                        )
                    print(f"stall round {number + 1}/{stall_rounds} done", flush=True)
        finally:
            daemon.stop()
    return _results(raw, stall, rounds, concurrent_n)


def _results(
    raw: dict[str, list[dict[str, Any]]],
    stall: dict[str, list[dict[str, Any]]],
    rounds: int,
    concurrent_n: int,
) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for name, results in raw.items():
        alone = [span for r in results for span in r["alone"]["spans"]]
        batch = [span for r in results for b in r["batch"] for span in b["spans"]]
        counters = {k: statistics.median(r["counters"][k] for r in results) for k in _COUNTERS}
        generated = counters["generation_tokens_total"]
        accepted = counters["spec_decode_num_accepted_tokens_total"]
        drafts = counters["spec_decode_num_drafts_total"]
        gaps = {kind: [g for s in stall[name] for g in s["gaps_ms"][kind]] for kind in STALL_ARMS}
        medians = {kind: statistics.median(v) for kind, v in gaps.items() if v}
        means = {kind: statistics.fmean(v) for kind, v in gaps.items() if v}
        configs[name] = {
            "speculative_config": CONFIGS[name],
            "alone": [_summary(alone, i) for i in range(len(REGIONS))],
            "concurrent": [_summary(batch, i) for i in range(len(REGIONS))],
            "counters_per_request_alone": counters,
            "engine_steps_per_request": counters["iteration_tokens_total_count"],
            "generated_tokens_per_request": generated,
            "verify_forwards_per_request": drafts,
            "drafts_accepted_per_request": accepted,
            "stall": {
                "median_gap_ms": medians,
                "mean_gap_ms": means,
                "max_gap_ms": {kind: max(v) for kind, v in gaps.items() if v},
                "stall_ratio_median": medians["spinning"] / medians["fast"],
                "stall_ratio_mean": means["spinning"] / means["fast"],
            },
            "sample_text": results[0]["alone"]["text"],
        }
    return {
        "regions": list(REGIONS),
        "rounds": rounds,
        "concurrent": concurrent_n,
        "stall_rounds": len(next(iter(stall.values()), [])),
        "configs": configs,
    }


def _rows(result: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The printed table: a label and one cell per configuration."""
    configs = list(result["configs"].values())

    def one(key: str) -> list[str]:
        return [f"{c[key]:.0f}" for c in configs]

    def pair(key: str, field: str, digits: int = 0) -> list[str]:
        return [f"{c[key][0][field]:.{digits}f} / {c[key][1][field]:.{digits}f}" for c in configs]

    return [
        ("engine steps per request alone", one("engine_steps_per_request")),
        ("generated tokens per request", one("generated_tokens_per_request")),
        ("verify forwards / drafts kept per request", [
            f"{c['verify_forwards_per_request']:.0f} / {c['drafts_accepted_per_request']:.0f}"
            for c in configs
        ]),
        ("steps per result, value / error (stream)", pair("alone", "steps_median")),
        ("close -> last token alone, ms", pair("alone", "latency_ms_median")),
        (f"the same, {result['concurrent']} at once, ms", pair("concurrent", "latency_ms_median")),
        ("stall ratio, median (mean)", [
            f"{c['stall']['stall_ratio_median']:.3f} ({c['stall']['stall_ratio_mean']:.3f})"
            for c in configs
        ]),
    ]  # fmt: skip


def _print(result: dict[str, Any]) -> None:
    print(f"{'':44s}" + "".join(f"{n:>22s}" for n in result["configs"]))
    for label, cells in _rows(result):
        print(f"{label:44s}" + "".join(f"{cell:>22s}" for cell in cells))


def _plot(result: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(result["configs"])
    configs = result["configs"]
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    width = 0.38
    xs = range(len(names))
    for index, label in enumerate(("value", "error")):
        offset = (index - 0.5) * width
        axes[0].bar([x + offset for x in xs],
                    [configs[n]["alone"][index]["steps_median"] for n in names], width,
                    label=f"{label} region")  # fmt: skip
        axes[1].bar([x + offset for x in xs],
                    [configs[n]["concurrent"][index]["latency_ms_median"] for n in names], width,
                    label=f"{label} region")  # fmt: skip
    axes[0].set_title("engine steps per result (alone)")
    axes[1].set_title(f"span close -> region end, {result['concurrent']} at once (ms)")
    axes[2].bar(list(xs), [configs[n]["stall"]["stall_ratio_median"] for n in names])
    axes[2].axhline(1.02, color="grey", linestyle="--", label="target 1.02")
    axes[2].set_title("stall ratio (median gap, spinning / fast)")
    for axis in axes:
        axis.set_xticks(list(xs), names)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "forwards.png", dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench vllm-forwards``."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--stall-rounds", type=int, default=4)
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated: " + ",".join(CONFIGS)
    )
    parser.add_argument("--out", type=Path, default=REPORT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        choices = ", ".join(CONFIGS)
        print(f"error: unknown --configs {unknown}; choose from {choices}", file=sys.stderr)
        return 2
    python = vllm_python()
    if python is None:
        print(
            "error: unavailable: the vLLM venv is absent: run `make vllm-venv` first",
            file=sys.stderr,
        )
        return 2
    result = run(python, names, args.rounds, args.concurrent, args.stall_rounds)
    _print(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forwards.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, args.out)
    return 0
