"""Would several daemon processes help? One daemon against two, side by side (a measurement
script, not a test).

    evald bench workers [--seconds S] [--rounds N] [--json FILE]

Starts two ``evald serve`` processes, each with its data path, and drives 64-item messages of
calc ``17 * 23 + 91`` from closed-loop callers (a thread and a data-path connection each): all
callers on one daemon, then the same callers split over both, alternating for several rounds so
a burst of load elsewhere hits both alike. Prints items/s and the daemons' CPU per item, and the
two-process ÷ one-process throughput ratio per round.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from evald.client import DataConnection
from evald.contract import pb
from evald.testing import DaemonProcess, start_daemon
from evald_lab.bench._common import cpu_seconds_of
from evald_lab.bench._overhead import bench_daemon_config

_MESSAGE = pb.EvaluateBatchRequest(
    items=[
        pb.EvaluateRequest(evaluator="calc", input=b"17 * 23 + 91", id=str(i)) for i in range(64)
    ]
)


def _drive(targets: list[str], callers: int, seconds: float) -> float:
    """Items/s of ``callers`` closed-loop callers spread round-robin over ``targets``."""
    connections = [DataConnection.connect(targets[i % len(targets)]) for i in range(callers)]
    counts = [0] * callers
    stop = time.perf_counter() + seconds

    def caller(index: int) -> None:
        connection = connections[index]
        while time.perf_counter() < stop:
            connection.send(_MESSAGE)
            got = 0
            while got < 64:
                response = connection.receive()
                assert response is not None, "the daemon closed the connection"
                got += len(response.results)
            counts[index] += 64

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for connection in connections:
        connection.close()
    return sum(counts) / wall


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``evald bench workers``."""
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="evald-workers-") as tmp:
        roots = [Path(tmp) / f"d{i}" for i in range(2)]
        daemons: list[DaemonProcess] = [
            start_daemon(root, bench_daemon_config(data_listen=f"unix:{root}/data.sock"))
            for root in roots
        ]
        try:
            targets = [f"unix:{root}/data.sock" for root in roots]
            for round_index in range(args.rounds):
                for callers in (2, 8):
                    rates: dict[int, float] = {}
                    for processes in (1, 2):
                        before = [cpu_seconds_of(d.pid) or 0.0 for d in daemons]
                        rate = _drive(targets[:processes], callers, args.seconds)
                        cpu = sum(
                            (cpu_seconds_of(d.pid) or 0.0) - b
                            for d, b in zip(daemons, before, strict=True)
                        )
                        rates[processes] = rate
                        rows.append(
                            {
                                "round": round_index,
                                "processes": processes,
                                "callers": callers,
                                "items_per_s": round(rate),
                                "daemon_cpu_us_per_item": round(
                                    cpu / (rate * args.seconds) * 1e6, 2
                                ),
                            }
                        )
                        print(
                            f"round {round_index} callers={callers} processes={processes}: "
                            f"{rate:9,.0f} items/s, daemons "
                            f"{rows[-1]['daemon_cpu_us_per_item']:5.1f} µs CPU/item"
                        )
                    print(f"  two ÷ one process: {rates[2] / rates[1]:.2f}")
        finally:
            for daemon in daemons:
                daemon.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0

