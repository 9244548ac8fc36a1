"""``evald bench daemon``: the daemon's round trips, ``isolation = "fresh"`` beside ``"reuse"``.

    evald bench daemon [--json FILE] [--rounds N] [--calls N]

Starts two ``evald serve`` processes that differ only in ``[host] isolation`` (each with its own
unix socket, data-path socket and state folder, two guest threads) and measures, from one
closed-loop caller in this process, the round trip of each path: unary ``Evaluate``;
``EvaluateBatch`` of 64 items; a gRPC stream carrying one message of 1 or 64 items per round
trip; the data path (``[server] data_listen``) with 1 or 64 items per message. The two daemons
take turns, ``--rounds`` times, ``--calls`` round trips each, so load from elsewhere hits both
alike. For each path: p50/p99 of the round trip and items/s (items over the summed round
trips), and fresh ÷ reuse of both: the targets are items/s at 64 items a message ≥ 0.8 and
round-trip p50 ≤ 1.1. The evaluator is ``calc`` on ``17 * 23 + 91``.

Then what each mode costs in memory: each daemon's resident set (``VmRSS``) and address space
(``VmSize``: the pooling allocator reserves its slots up front) idle after the warm-up, and the
peak resident set while 64 data-path connections keep one call each in flight (sampled every
10 ms for ``--memory-s`` seconds).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from evald.contract import pb
from evald.testing import DaemonProcess, start_daemon
from evaluators_wasm import wasm_path

__all__ = ["MODES", "PATHS", "add_arguments", "main", "measure"]

MODES = ("fresh", "reuse")
#: path name -> items per round trip
PATHS = {
    "unary": 1,
    "batch64": 64,
    "stream1": 1,
    "stream64": 64,
    "data1": 1,
    "data64": 64,
}
_DATA = b"17 * 23 + 91"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``evald bench daemon``."""
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rounds", type=int, default=5, help="turns of each daemon (default 5)")
    parser.add_argument(
        "--calls", type=int, default=200, help="round trips per path and turn (default 200)"
    )
    parser.add_argument(
        "--memory-s", type=float, default=3.0, help="seconds of 64 concurrent calls (default 3)"
    )


class _Paths:
    """One daemon's six round trips, each a function that returns the results it received."""

    def __init__(self, daemon: DaemonProcess, data_target: str) -> None:
        import grpc

        from evald.client import DataConnection
        from evald.contract import pb_grpc

        self._channel = grpc.insecure_channel(daemon.target)
        stub: Any = pb_grpc.EvaluatorStub(self._channel)  # type: ignore[no-untyped-call]
        single = pb.EvaluateRequest(evaluator="calc", input=_DATA, id="0")
        one = pb.EvaluateBatchRequest(items=[single])
        many = pb.EvaluateBatchRequest(
            items=[pb.EvaluateRequest(evaluator="calc", input=_DATA, id=str(i)) for i in range(64)]
        )
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._stream = stub.EvaluateStream(self._requests())
        self._data = DataConnection.connect(data_target)

        def streamed(message: Any, items: int) -> Callable[[], list[Any]]:
            def call() -> list[Any]:
                self._outbox.put(message)
                results: list[Any] = []
                while len(results) < items:
                    results.extend(next(self._stream).results)
                return results

            return call

        def on_data_path(message: Any, items: int) -> Callable[[], list[Any]]:
            def call() -> list[Any]:
                self._data.send(message)
                results: list[Any] = []
                while len(results) < items:
                    response = self._data.receive()
                    if response is None:
                        raise RuntimeError("the daemon closed the data-path connection")
                    results.extend(response.results)
                return results

            return call

        self.calls: dict[str, Callable[[], list[Any]]] = {
            "unary": lambda: [stub.Evaluate(single)],
            "batch64": lambda: list(stub.EvaluateBatch(many).results),
            "stream1": streamed(one, 1),
            "stream64": streamed(many, 64),
            "data1": on_data_path(one, 1),
            "data64": on_data_path(many, 64),
        }

    def _requests(self) -> Iterator[Any]:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            yield message

    def close(self) -> None:
        self._outbox.put(None)
        for _ in self._stream:
            pass
        self._data.close()
        self._channel.close()


def _config(mode: str, data_listen: str) -> str:
    from evald_lab.bench._overhead import bench_daemon_config

    config = bench_daemon_config(threads=2, data_listen=data_listen)
    # 64 callers on the data path beside the round trips' own connection
    config = config.replace("[server]\n", "[server]\ndata_max_connections = 256\n", 1)
    return config + f'[host]\nisolation = "{mode}"\n'



def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _memory_under_load(daemon: DaemonProcess, data_target: str, seconds: float) -> dict[str, Any]:
    """Idle RSS and address space, then the peak RSS under 64 concurrent data-path callers."""
    import threading

    from evald.client import DataConnection

    idle = {
        "idle_rss_bytes": _status_bytes(daemon.pid, "VmRSS"),
        "address_space_bytes": _status_bytes(daemon.pid, "VmSize"),
    }
    message = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=_DATA, id="0")]
    )
    done = threading.Event()
    connections = [DataConnection.connect(data_target) for _ in range(64)]
    calls = [0]

    def caller(connection: Any) -> None:
        while not done.is_set():
            connection.send(message)
            if connection.receive() is None:
                return
            calls[0] += 1

    threads = [threading.Thread(target=caller, args=(c,), daemon=True) for c in connections]
    for thread in threads:
        thread.start()
    peak = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, _status_bytes(daemon.pid, "VmRSS"))
        time.sleep(0.01)
    done.set()
    for thread in threads:
        thread.join(timeout=10)
    for connection in connections:
        connection.close()
    return {**idle, "peak_rss_64_calls_bytes": peak, "calls_during": calls[0]}


def measure(rounds: int, calls: int, memory_s: float = 0.0) -> dict[str, Any]:
    """Runs the two daemons in turns (see the module docstring); returns the result document.

    Raises:
        RuntimeError: a daemon did not start, or answered anything but calc's value.
    """
    latencies: dict[tuple[str, str], list[int]] = {(m, p): [] for m in MODES for p in PATHS}
    memory: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="evald-bench-") as tmp:
        daemons: dict[str, DaemonProcess] = {}
        paths: dict[str, _Paths] = {}
        try:
            for mode in MODES:
                data_target = f"unix:{Path(tmp) / (mode + '-data.sock')}"
                daemons[mode] = start_daemon(Path(tmp) / mode, _config(mode, data_target))
                paths[mode] = _Paths(daemons[mode], data_target)
            for mode in MODES:  # warm every worker's instance and each connection
                for call in paths[mode].calls.values():
                    for _ in range(20):
                        call()
            clock = time.perf_counter_ns
            for round_index in range(rounds):
                order = MODES if round_index % 2 == 0 else MODES[::-1]
                for path in PATHS:
                    for mode in order:
                        call, sink = paths[mode].calls[path], latencies[mode, path]
                        for _ in range(calls):
                            started = clock()
                            results = call()
                            sink.append(clock() - started)
                            if any(r.WhichOneof("outcome") != "value" for r in results):
                                raise RuntimeError(f"{mode} {path}: {results[0]}")
            if memory_s > 0:
                for mode in MODES:
                    target = f"unix:{Path(tmp) / (mode + '-data.sock')}"
                    memory[mode] = _memory_under_load(daemons[mode], target, memory_s)
        finally:
            for made in paths.values():
                made.close()
            for daemon in daemons.values():
                daemon.stop()
    rows: dict[str, Any] = {}
    for path, items in PATHS.items():
        row: dict[str, Any] = {"items_per_message": items}
        for mode in MODES:
            samples = sorted(latencies[mode, path])
            row[mode] = {
                "p50_us": round(statistics.median(samples) / 1000, 1),
                "p99_us": round(samples[int(0.99 * (len(samples) - 1))] / 1000, 1),
                "items_per_s": round(items * len(samples) / (sum(samples) / 1e9), 1),
            }
        row["fresh_vs_reuse_p50"] = round(row["fresh"]["p50_us"] / row["reuse"]["p50_us"], 3)
        row["fresh_vs_reuse_items_per_s"] = round(
            row["fresh"]["items_per_s"] / row["reuse"]["items_per_s"], 3
        )
        rows[path] = row
    batched = [rows[p]["fresh_vs_reuse_items_per_s"] for p in PATHS if PATHS[p] == 64]
    return {
        "benchmark": "daemon",
        "evaluator": "calc",
        "input": _DATA.decode(),
        "rounds": rounds,
        "calls_per_round": calls,
        "paths": rows,
        "memory": memory,
        "targets": {
            "items_per_s_at_64_fresh_vs_reuse": {"target": 0.8, "worst": min(batched)},
            "p50_fresh_vs_reuse": {
                "target": 1.1,
                "worst": max(rows[p]["fresh_vs_reuse_p50"] for p in PATHS),
            },
        },
    }


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: calc is not built)."""
    if not wasm_path("calc").exists():
        print("calc.wasm is not built (make wasm)")
        return 2
    from evald_lab.bench._common import load_average, machine_info

    document = measure(args.rounds, args.calls, args.memory_s)
    document["machine"] = {**machine_info(), "load_average_at_end": load_average()}
    print(f"{'path':<10} {'reuse p50':>10} {'fresh p50':>10} {'÷':>6} {'reuse/s':>10} "
          f"{'fresh/s':>10} {'÷':>6}")  # fmt: skip
    for path, row in document["paths"].items():
        print(
            f"{path:<10} {row['reuse']['p50_us']:>10} {row['fresh']['p50_us']:>10} "
            f"{row['fresh_vs_reuse_p50']:>6} {row['reuse']['items_per_s']:>10,.0f} "
            f"{row['fresh']['items_per_s']:>10,.0f} {row['fresh_vs_reuse_items_per_s']:>6}"
        )
    for mode, held in document["memory"].items():
        print(
            f"{mode}: RSS idle {held['idle_rss_bytes'] / 2**20:.1f} MiB, under 64 calls "
            f"{held['peak_rss_64_calls_bytes'] / 2**20:.1f} MiB; address space "
            f"{held['address_space_bytes'] / 2**30:.1f} GiB"
        )
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0
