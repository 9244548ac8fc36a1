"""What does the adapter cost a real SGLang CPU server? Two comparisons, each measured side by side
on two servers that run at once and take turns (``--sleep-on-idle``: the idle one takes no CPU):

1. **Requests without spans**: the same plain requests on a server with the adapter loaded
   (``EVALD_TARGET`` set: every hook installed) and on one without it. Aggregate decode
   throughput, loaded ÷ not (target >= 0.99), with a bootstrap interval of the machine's
   noise; and the time the hooks take per step, as the loaded server logs it.
2. **A mix with spans**: the same evaluated requests (four calc spans each, next to plain ones)
   with spans evaluated by evald over its data path (a separate, sandboxed process) and by the
   same WASM host inside the server process (``EVALD_INPROCESS=1``, no isolation). Request
   latency and throughput, evald ÷ in-process: what isolation costs in a real server's batch.

Prints the ratios, writes ``reports/sglang/cost.json`` and a plot.

    engine-adapter bench sglang-cost [--rounds 6]

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
from pathlib import Path
from typing import Any

from engine_adapter.testing import PLAIN_PROMPTS as ALL_PLAIN_PROMPTS
from engine_adapter.testing import fixed_tag, spans_in
from engine_adapter.testing.sglang import (
    CONFIG,
    DEADLINE_MS,
    TOKEN,
    SglangServer,
    sglang_python,
    start_server,
)

#: Relative to the checkout the command runs in, like every benchmark\'s results.
REPORT_DIR = Path("reports") / "sglang"
PLAIN_PROMPTS = ALL_PLAIN_PROMPTS[:8]


def plain_round(server: SglangServer, requests: int, max_tokens: int) -> float:
    """Aggregate tokens per second of ``requests`` plain requests at once."""
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        answers = list(
            pool.map(
                lambda i: server.generate(
                    PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)], max_new_tokens=max_tokens,
                    ignore_eos=True,
                ),
                range(requests),
            )
        )  # fmt: skip
    tokens = sum(int(a["meta_info"]["completion_tokens"]) for a in answers)
    return tokens / (time.monotonic() - started)


def span_round(server: SglangServer, tag: dict[str, Any], requests: int) -> dict[str, float]:
    """``requests`` evaluated requests next to as many plain ones: their median latency and
    the round's requests per second."""
    started = time.monotonic()

    def evaluated(_: int) -> float:
        begin = time.monotonic()
        answer = server.generate("Compute:", max_new_tokens=200, structural_tag=tag)
        assert len(spans_in(answer["text"])) == 4, answer["text"]
        return time.monotonic() - begin

    with concurrent.futures.ThreadPoolExecutor(2 * requests) as pool:
        plain = [
            pool.submit(server.generate, PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)], max_new_tokens=32)
            for i in range(requests)
        ]
        latencies = list(pool.map(evaluated, range(requests)))
        for call in plain:
            call.result()
    return {
        "latency_ms": statistics.median(latencies) * 1e3,
        "requests_per_s": 2 * requests / (time.monotonic() - started),
    }


def hook_cost_us(server: SglangServer) -> float | None:
    """What the adapter's scheduler hooks cost per step, as the server last logged it."""
    import re

    found = re.findall(r"scheduler hooks ([0-9.]+) us per step", server.log())
    return float(found[-1]) if found else None


def ratio_interval(
    numerator: list[float], denominator: list[float], *, draws: int = 2000
) -> tuple[float, float]:
    """A bootstrap 95 % interval of median(numerator) ÷ median(denominator): how far the
    machine's round-to-round noise leaves the ratio open."""
    import random

    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(numerator, k=len(numerator)))
        / statistics.median(rng.choices(denominator, k=len(denominator)))
        for _ in range(draws)
    )
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def alternate(rounds: int, pair: dict[str, Any]) -> dict[str, list[Any]]:
    """Runs ``pair``'s two measurements in turns (A B B A …) so both see the same machine."""
    names = list(pair)
    samples: dict[str, list[Any]] = {name: [] for name in names}
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            samples[name].append(pair[name]())
    return samples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine-adapter bench sglang-cost``."""
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--scheduler", default="normal")
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
    from engine_adapter import list_evaluators
    from evald.testing import DaemonProcess, start_daemon

    result: dict[str, Any] = {"scheduler": args.scheduler, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="evald-sgl-") as tmp:
        root = Path(tmp)
        data_socket = root / "evald-data.sock"
        config = CONFIG.replace("[server]\n", f'[server]\ndata_listen = "unix:{data_socket}"\n', 1)
        daemon: DaemonProcess = start_daemon(root / "evald", config)
        base = {
            "EVALD_TARGET": daemon.target,
            "EVALD_TOKEN": TOKEN,
            "EVALD_DEADLINE_MS": str(DEADLINE_MS),
        }
        try:
            servers = {
                "off": start_server(python, {}, root / "off.log", scheduler=args.scheduler),
                "on": start_server(python, base, root / "on.log", scheduler=args.scheduler),
            }
            try:
                for server in servers.values():
                    plain_round(server, 2, 8)  # warm
                samples = alternate(
                    args.rounds,
                    {
                        name: (lambda s=s: plain_round(s, args.requests, args.max_tokens))
                        for name, s in servers.items()
                    },
                )
                hooks = hook_cost_us(servers["on"])
            finally:
                for server in servers.values():
                    server.stop()
            result["hook_us_per_step"] = hooks
            result["plain_tokens_per_s"] = {n: statistics.median(v) for n, v in samples.items()}
            step_us = args.requests / result["plain_tokens_per_s"]["on"] * 1e6
            result["hook_share_of_step"] = hooks / step_us if hooks is not None else None
            result["plain_samples"] = samples
            result["plain_on_over_off"] = (
                result["plain_tokens_per_s"]["on"] / result["plain_tokens_per_s"]["off"]
            )
            result["plain_on_over_off_95"] = ratio_interval(samples["on"], samples["off"])
            low, high = result["plain_on_over_off_95"]
            print(
                f"plain requests: {result['plain_tokens_per_s']['on']:.1f} tok/s with the adapter "
                f"loaded, {result['plain_tokens_per_s']['off']:.1f} without: "
                f"{result['plain_on_over_off']:.3f} (95 % interval {low:.3f} to {high:.3f}); "
                f"the server's own count: the adapter's hooks {hooks} us per step, "
                f"{(result['hook_share_of_step'] or 0) * 100:.4f} % of a decode step",
                flush=True,
            )
            calc = {s.name: s for s in list_evaluators(daemon.target, TOKEN)}["calc"].binding()
            parts: list[Any] = ["So "]
            for i in range(4):
                parts += [(calc, f"{17 + i} * {23 + i} + {91 * i}"), ", "]
            tag = fixed_tag(*parts[:-1], ".")
            servers = {
                "evald": start_server(
                    python, {**base, "EVALD_DATA_TARGET": f"unix:{data_socket}"},
                    root / "evald.log", scheduler=args.scheduler,
                ),
                "inprocess": start_server(
                    python, {**base, "EVALD_INPROCESS": "1"}, root / "inprocess.log",
                    scheduler=args.scheduler,
                ),
            }  # fmt: skip
            try:
                for server in servers.values():
                    span_round(server, tag, 2)  # warm
                spans = alternate(
                    args.rounds,
                    {
                        name: (lambda s=s: span_round(s, tag, args.requests))
                        for name, s in servers.items()
                    },
                )
            finally:
                for server in servers.values():
                    server.stop()
        finally:
            daemon.stop()
    result["spans"] = {
        name: {
            key: statistics.median(sample[key] for sample in values)
            for key in ("latency_ms", "requests_per_s")
        }
        for name, values in spans.items()
    }
    result["span_samples"] = spans
    result["spans_latency_95"] = ratio_interval(
        [x["latency_ms"] for x in spans["evald"]], [x["latency_ms"] for x in spans["inprocess"]]
    )
    result["spans_evald_over_inprocess"] = {
        "latency": result["spans"]["evald"]["latency_ms"]
        / result["spans"]["inprocess"]["latency_ms"],
        "throughput": result["spans"]["evald"]["requests_per_s"]
        / result["spans"]["inprocess"]["requests_per_s"],
    }
    print(
        "requests with four spans: median latency "
        f"{result['spans']['evald']['latency_ms']:.0f} ms through evald's data path, "
        f"{result['spans']['inprocess']['latency_ms']:.0f} ms in-process "
        f"({result['spans_evald_over_inprocess']['latency']:.3f}, 95 % interval "
        f"{result['spans_latency_95'][0]:.3f} to {result['spans_latency_95'][1]:.3f}); throughput "
        "ratio "
        f"{result['spans_evald_over_inprocess']['throughput']:.3f}",
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "cost.png")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    plain = result["plain_samples"]
    left.boxplot([plain["off"], plain["on"]])
    left.set_xticks([1, 2], ["adapter not loaded", "adapter loaded"])
    left.set_ylabel("plain requests, tok/s")
    left.set_title(f"loaded ÷ not: {result['plain_on_over_off']:.3f}", fontsize=9)
    spans = result["span_samples"]
    right.boxplot([[s["latency_ms"] for s in spans[n]] for n in ("inprocess", "evald")])
    right.set_xticks([1, 2], ["in-process WASM", "evald data path"])
    right.set_ylabel("request with 4 spans, ms")
    ratio = result["spans_evald_over_inprocess"]["latency"]
    right.set_title(f"evald ÷ in-process latency: {ratio:.3f}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
