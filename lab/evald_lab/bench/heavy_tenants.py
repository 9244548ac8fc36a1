"""Heavy tenants yield the CPU: a victim's latency next to a tenant that loops to its deadline on
every call, with the heavy tenant's workers lowered (``heavy_tenant_nice = 19``) and without
(``0``), on a quiet machine, on a busy one, and as a service beside two CPU hogs, side by side in
one run.

    evald bench heavy-tenants [--samples N] [--rounds R] [--out DIR]

Each configuration gets a daemon of its own (2 worker threads, unix socket): the victim's
sequential unary ``calc`` calls are timed alone, then while the attacker calls an infinite loop
(20 ms deadline, no fuel limit) back to back from 2 threads. "busy" runs a CPU-bound process of
normal priority beside the daemon for the whole configuration (an inference server's busy core).
"service" starts the daemon in a session of its own, as a service runs, so it lowers its own
scheduling group while a worker is lowered (docs/daemon.md), beside two CPU-bound processes of
the benchmark's session: what that lowering costs the *other* tenants' calls on a contended
machine (the whole daemon shares the group), and how much CPU the attacker still takes from the
machine. A victim phase ends after ``samples`` calls or :data:`PHASE_MAX_S`, whichever first.
Configurations are interleaved round by round, so a burst of load hits all alike; the figures
are medians over the rounds. Writes ``heavy_tenants.json`` and ``heavy_tenants.png`` to
``--out`` (default reports/bench) and prints the lowered/normal ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from evald.client import CallError, Client
from evald.testing import (
    DaemonProcess,
    cpu_hogs,
    named_guest,
    process_alive,
    process_cpu_s,
    process_descendants,
    start_daemon,
    tenant_table,
)
from evald_lab.bench._common import (
    DEFAULT_OUT_DIR,
    load_average,
    machine_info,
    percentile,
    write_json,
)

__all__ = ["add_arguments", "main", "run"]

#: The two tenants' tokens (the config holds their hashes).
TOKENS = {"victim": "victim-token-0123456789", "attacker": "attacker-token-0123456789"}
NICE_VALUES = (0, 19)
CONDITIONS = ("quiet", "busy", "service")
#: The condition's CPU-bound processes of normal priority, in the benchmark's session.
HOGS = {"quiet": 0, "busy": 1, "service": 2}
#: A victim phase's longest run (a lowered group on a contended machine answers slowly).
PHASE_MAX_S = 10.0
ATTACKER_THREADS = 2
ATTACKER_DEADLINE_MS = 20
#: How long a configuration's daemon may take to drain before it is killed.
STOP_TIMEOUT_S = 30.0


def _config(nice: int) -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            f"heavy_tenant_nice = {nice}",
            "shutdown_grace_s = 2",
            tenant_table("victim", token=TOKENS["victim"], evaluators=["calc"]),
            tenant_table(
                "attacker",
                token=TOKENS["attacker"],
                allow_register=True,
                limits={"fuel": 0, "deadline_ms": ATTACKER_DEADLINE_MS},
            ),
        ]
    )


def _victim(client: Client, samples: int) -> tuple[list[float], int]:
    """The victim's sequential calls: their latencies, and how many did not answer 482 (an
    evaluation that ran past the victim's own deadline while its worker waited for a CPU, or a
    call that found no answer within the client's deadline on a machine loaded past the
    benchmark's own hogs: counted as failed at that deadline, so the phase still ends)."""
    latencies: list[float] = []
    wrong = 0
    until = time.monotonic() + PHASE_MAX_S
    while len(latencies) < samples and time.monotonic() < until:
        began = time.perf_counter()
        try:
            answered = client.evaluate("calc", b"17 * 23 + 91").value == "482"
        except CallError:
            answered = False
        latencies.append((time.perf_counter() - began) * 1000)
        wrong += not answered
    return latencies, wrong


def _figures(phase: tuple[list[float], int]) -> dict[str, float]:
    latencies_ms, wrong = phase
    ordered = sorted(latencies_ms)
    return {
        "p50_ms": round(percentile(ordered, 0.5), 3),
        "p99_ms": round(percentile(ordered, 0.99), 3),
        "calls": len(ordered),
        "failed": wrong,
    }


def _one(root: Path, nice: int, condition: str, samples: int) -> dict[str, Any]:
    """One configuration on a daemon of its own: the victim alone, then under attack. The hogs,
    the daemon and the burners are ended however the configuration ends (a failed call, a
    daemon that does not stop in time), so a failure leaves nothing running."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_hogs(HOGS[condition]))
        daemon: DaemonProcess = start_daemon(
            root, _config(nice), own_session=condition == "service"
        )
        stack.callback(_end, daemon)
        victim = stack.enter_context(
            contextlib.closing(Client(daemon.target, TOKENS["victim"], timeout_s=30))
        )
        attacker = stack.enter_context(
            contextlib.closing(Client(daemon.target, TOKENS["attacker"], timeout_s=30))
        )
        attacker.register(named_guest("loop", "spin"))
        _victim(victim, min(100, samples))  # warm the channel and the instances
        alone = _victim(victim, samples)
        with _Burners(daemon.target) as burners:
            began = time.perf_counter()
            cpu_before = _cpu_s(daemon.pid)
            loaded = _victim(victim, samples)
            elapsed = time.perf_counter() - began
            cpu = _cpu_s(daemon.pid) - cpu_before
        return {
            "alone": _figures(alone),
            "under_attack": _figures(loaded),
            "attacker_calls_per_s": round(burners.calls / elapsed, 1),
            "daemon_cpu_share": round(cpu / elapsed, 3),
        }


def _end(daemon: DaemonProcess) -> None:
    """Stops the daemon; one that does not drain within its grace is killed with everything it
    started (its compile worker), so a benchmark that failed leaves nothing behind."""
    try:
        daemon.stop(timeout_s=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        below = process_descendants(daemon.pid)
        daemon.kill()
        for pid in below:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        gone_by = time.monotonic() + STOP_TIMEOUT_S  # a kill takes effect a moment later
        while any(process_alive(pid) for pid in below) and time.monotonic() < gone_by:
            time.sleep(0.05)


class _Burners:
    """The attacker's threads, each calling the spinning evaluator back to back for the block;
    stopped and joined at its end, however it ends."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._stop = threading.Event()
        self._counts = [0] * ATTACKER_THREADS
        self._threads = [
            threading.Thread(target=self._burn, args=(slot,), daemon=True)
            for slot in range(ATTACKER_THREADS)
        ]

    @property
    def calls(self) -> int:
        """Calls the attacker made so far, all threads."""
        return sum(self._counts)

    def _burn(self, slot: int) -> None:
        with contextlib.closing(Client(self._target, TOKENS["attacker"], timeout_s=30)) as client:
            while not self._stop.is_set():
                try:
                    client.evaluate("spin", b"")
                except CallError:
                    continue  # a loaded machine: the attack goes on
                self._counts[slot] += 1

    def __enter__(self) -> _Burners:
        for thread in self._threads:
            thread.start()
        time.sleep(0.3)  # every burner has a call running
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def _cpu_s(pid: int) -> float:
    """The daemon's CPU seconds so far (it runs until the configuration ends)."""
    used = process_cpu_s(pid)
    assert used is not None, f"the daemon (pid {pid}) is gone"
    return used


def _median(runs: list[dict[str, Any]], *path: str) -> float:
    values = []
    for figures in runs:
        value: Any = figures
        for key in path:
            value = value[key]
        values.append(float(value))
    return round(statistics.median(values), 3)


def _failed_share(runs: list[dict[str, Any]]) -> float:
    """The share of the victim's calls under attack, over every run, that did not answer."""
    calls = sum(int(run["under_attack"]["calls"]) for run in runs)
    failed = sum(int(run["under_attack"]["failed"]) for run in runs)
    return round(failed / max(calls, 1), 4)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "alone": {key: _median(runs, "alone", key) for key in ("p50_ms", "p99_ms")},
        "under_attack": {key: _median(runs, "under_attack", key) for key in ("p50_ms", "p99_ms")}
        | {"failed_share": _failed_share(runs)},
        "attacker_calls_per_s": _median(runs, "attacker_calls_per_s"),
        "daemon_cpu_share": _median(runs, "daemon_cpu_share"),
        "runs": runs,
    }


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    positions = range(len(CONDITIONS))
    for axis, key in zip(axes, ("p50_ms", "p99_ms"), strict=True):
        for offset, nice in ((-0.2, 0), (0.2, 19)):
            values = [
                result["conditions"][condition][f"nice_{nice}"]["under_attack"][key]
                for condition in CONDITIONS
            ]
            axis.bar(
                [p + offset for p in positions], values, 0.4, label=f"heavy_tenant_nice {nice}"
            )
        axis.set_xticks(list(positions), CONDITIONS)
        axis.set_ylabel(f"victim {key.replace('_ms', '')} under attack (ms)")
        axis.set_yscale("log")
        axis.set_ylim(top=axis.get_ylim()[1] * 4)  # room for the legend above the bars
        axis.legend(loc="upper left", fontsize=8)
    fig.suptitle("Victim latency next to a tenant looping to its deadline (2 workers, 2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(samples: int, rounds: int, out: Path) -> dict[str, Any]:
    """Measures every configuration ``rounds`` times, interleaved; writes the result files."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {
        (condition, nice): [] for condition in CONDITIONS for nice in NICE_VALUES
    }
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="evald-bench-") as tmp:
        for index in range(rounds):
            for condition, nice in runs:
                root = Path(tmp) / f"{index}-{condition}-{nice}"
                runs[condition, nice].append(_one(root, nice, condition, samples))
    conditions: dict[str, Any] = {}
    for condition in CONDITIONS:
        normal = _summary(runs[condition, 0])
        lowered = _summary(runs[condition, 19])
        conditions[condition] = {
            "nice_0": normal,
            "nice_19": lowered,
            "lowered_over_normal": {
                key: round(lowered["under_attack"][key] / normal["under_attack"][key], 2)
                for key in ("p50_ms", "p99_ms")
            }
            | {
                "attacker_calls_per_s": round(
                    lowered["attacker_calls_per_s"] / normal["attacker_calls_per_s"], 2
                ),
                "daemon_cpu_share": round(
                    lowered["daemon_cpu_share"] / max(normal["daemon_cpu_share"], 1e-3), 2
                ),
            },
        }
    result: dict[str, Any] = {
        "benchmark": "heavy_tenants",
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": load_average()},
        "samples_per_phase": samples,
        "rounds": rounds,
        "attacker": f"{ATTACKER_THREADS} threads, an infinite loop, {ATTACKER_DEADLINE_MS} ms "
        "deadline",
        "conditions": conditions,
    }
    write_json(out / "heavy_tenants.json", result)
    result["plot"] = _plot(result, out / "heavy_tenants.png")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``evald bench heavy-tenants``."""
    parser.add_argument("--samples", type=int, default=1000, help="victim calls per phase")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each configuration")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark and prints the figures; returns the exit status."""
    result = run(args.samples, args.rounds, args.out)
    for condition, figures in result["conditions"].items():
        normal, lowered = figures["nice_0"], figures["nice_19"]
        ratios = figures["lowered_over_normal"]
        print(
            f"{condition:>7}: victim under attack p50 {normal['under_attack']['p50_ms']} -> "
            f"{lowered['under_attack']['p50_ms']} ms (x{ratios['p50_ms']}), p99 "
            f"{normal['under_attack']['p99_ms']} -> {lowered['under_attack']['p99_ms']} ms "
            f"(x{ratios['p99_ms']}); alone p99 {normal['alone']['p99_ms']} / "
            f"{lowered['alone']['p99_ms']} ms; attacker calls/s "
            f"{normal['attacker_calls_per_s']} -> {lowered['attacker_calls_per_s']} "
            f"(x{ratios['attacker_calls_per_s']}); daemon's CPU share "
            f"{normal['daemon_cpu_share']} -> {lowered['daemon_cpu_share']}; victim calls "
            f"failed {normal['under_attack']['failed_share']:.2%} -> "
            f"{lowered['under_attack']['failed_share']:.2%}"
        )
    print(f"wrote {args.out / 'heavy_tenants.json'}")
    return 0
