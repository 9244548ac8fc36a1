"""``evald bench daemon``: latency and throughput of the daemon over its unix socket.

    evald bench daemon [--json FILE] [--calls N] [--batches N]

Starts ``evald serve`` (default config, a temporary socket and state folder) and measures, from
a blocking gRPC client in this process: unary ``Evaluate`` latency (p50/p90/p99), one
``EvaluateBatch`` of 64 items (latency and items/s), and a stream carrying one 64-item message
per round trip. The evaluator is ``calc`` on ``17 * 23 + 91`` (an echo module when calc is not
built). Numbers are machine-dependent and noisy on a shared machine: compare orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from evald.client import Client
from evald.contract import pb
from evald.testing import DaemonProcess, named_guest, start_daemon, tenant_table
from evaluators_wasm import wasm_path


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6

    return {"p50_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``evald bench daemon``."""
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--calls", type=int, default=2000, help="unary calls (default 2000)")
    parser.add_argument("--batches", type=int, default=200, help="64-item batches (default 200)")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status."""
    config = "[server]\nthreads = 2\n" + tenant_table(
        "local", evaluators=["*"], allow_register=True
    )
    with tempfile.TemporaryDirectory(prefix="evald-bench-") as tmp:
        daemon: DaemonProcess = start_daemon(Path(tmp), config)
        try:
            client = Client(daemon.target)
            if wasm_path("calc").exists():
                evaluator, data = "calc", b"17 * 23 + 91"
            else:
                client.register(named_guest("echo", "bench_echo"))
                evaluator, data = "bench_echo", b"17 * 23 + 91"
            for _ in range(200):  # warm every worker's instance and the channel
                client.evaluate(evaluator, data)
            unary: list[float] = []
            in_daemon: list[int] = []
            for _ in range(args.calls):
                started = time.perf_counter()
                response = client.evaluate(evaluator, data)
                unary.append(time.perf_counter() - started)
                in_daemon.append(response.eval_time_us)
            items = [(evaluator, data)] * 64
            batches: list[float] = []
            for _ in range(args.batches):
                started = time.perf_counter()
                results = client.evaluate_batch(items)
                batches.append(time.perf_counter() - started)
                assert all(r.WhichOneof("outcome") == "value" for r in results)
            message = [
                pb.EvaluateRequest(evaluator=evaluator, input=data, id=str(i)) for i in range(64)
            ]
            started = time.perf_counter()
            streamed = client.evaluate_stream([message] * args.batches, timeout_s=300)
            stream_s = time.perf_counter() - started
            assert len(streamed) == 64 * args.batches
            client.close()
        finally:
            daemon.stop()
    batch_p50 = statistics.median(batches)
    results_doc = {
        "evaluator": evaluator,
        "unary": {**percentiles(unary), "calls_per_s": len(unary) / sum(unary)},
        "unary_in_daemon_p50_us": statistics.median(in_daemon),
        "batch64": {**percentiles(batches), "items_per_s": 64 / batch_p50},
        "stream64_pipelined_items_per_s": 64 * args.batches / stream_s,
    }
    print(json.dumps(results_doc, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results_doc, indent=2) + "\n")
    return 0

