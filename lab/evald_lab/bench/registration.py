"""Registration as a neighbour: other tenants' latency while one registers heavy modules, with
compilation in the daemon's process (as before) and in its worker process (now), in one run.

    evald bench registration [--seconds S] [--out DIR]

For each variant a daemon is started (2 worker threads, unix socket) and the victim's unary
``calc`` latency is measured alone, then while the attacker registers modules of about 1 MiB of
code back to back (new bytes every time). "in-process" replaces the worker process by a direct
call on the daemon's control thread, which is what registration did before. Also measured, on
the current daemon: how long registering bytes another tenant uploaded (and deleted) takes
against unseen bytes (a ratio near 1: no cross-tenant oracle). Writes ``registration.json`` and
``registration.png`` to ``--out`` (default reports/bench) and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from evald.client import Client
from evald.contract import append_custom_section
from evald.testing import DaemonProcess, start_daemon, tenant_table
from evald_lab.fuzz.noisy import heavy_module

#: Runs ``evald`` with registration compiling on the daemon's control thread (the old path).
_IN_PROCESS = (
    "import sys\n"
    "from evald.host import _compiler\n"
    "_compiler.Compiler.compile = lambda self, config, wasm, cap: "
    "_compiler.compile_module(config, wasm, cap)\n"
    "from evald.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


#: The two tenants' tokens (the config holds their hashes).
TOKENS = {name: f"{name}-token-0123456789" for name in ("alpha", "beta")}


def _config() -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "shutdown_grace_s = 2",
            tenant_table(
                "alpha", token=TOKENS["alpha"], evaluators=["calc"], allow_register=True,
                max_modules=8,
            ),
            tenant_table(
                "beta", token=TOKENS["beta"], evaluators=["calc"], allow_register=True,
                max_modules=8,
            ),
        ]
    )


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(ordered[-1] * 1000, 3)}


def _victim(client: Client, seconds: float) -> list[float]:
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.perf_counter()
        response = client.evaluate("calc", b"17 * 23 + 91")
        latencies.append(time.perf_counter() - began)
        assert response.value == "482", response
    return latencies


def _neighbour(daemon: DaemonProcess, seconds: float, heavy: bytes) -> dict[str, Any]:
    victim = Client(daemon.target, TOKENS["alpha"])
    attacker = Client(daemon.target, TOKENS["beta"], timeout_s=120)
    attacker.register(heavy, replace=True)  # warm: the worker process is started
    _victim(victim, 0.5)
    alone = _victim(victim, seconds)
    stop = threading.Event()
    registrations: list[float] = []

    def register() -> None:
        index = 0
        while not stop.is_set():
            wasm = append_custom_section(heavy, "pad", index.to_bytes(8, "little"))
            index += 1
            began = time.perf_counter()
            attacker.register(wasm, replace=True)
            registrations.append(time.perf_counter() - began)

    thread = threading.Thread(target=register)
    thread.start()
    time.sleep(0.5)
    try:
        loaded = _victim(victim, seconds)
    finally:
        stop.set()
        thread.join()
    victim.close()
    attacker.close()
    a, b = _percentiles(alone), _percentiles(loaded)
    return {
        "alone": a,
        "during_registrations": b,
        "victim_calls": [len(alone), len(loaded)],
        "ratio_p50": round(b["p50_ms"] / a["p50_ms"], 2),
        "ratio_p99": round(b["p99_ms"] / a["p99_ms"], 2),
        "registrations": len(registrations),
        "median_registration_s": round(statistics.median(registrations), 3),
    }


def _oracle(daemon: DaemonProcess, rounds: int, heavy: bytes) -> dict[str, Any]:
    """Median registration time of bytes the other tenant uploaded and deleted, and of unseen
    bytes, alternating."""
    alpha = Client(daemon.target, TOKENS["alpha"], timeout_s=120)
    beta = Client(daemon.target, TOKENS["beta"], timeout_s=120)
    seen, unseen = [], []
    for index in range(rounds):
        known = append_custom_section(heavy, "pad", f"known{index}".encode())
        beta.register(known, replace=True)
        beta.delete("noisy_register")
        began = time.perf_counter()
        alpha.register(known, replace=True)
        seen.append(time.perf_counter() - began)
        fresh = append_custom_section(heavy, "pad", f"fresh{index}".encode())
        began = time.perf_counter()
        alpha.register(fresh, replace=True)
        unseen.append(time.perf_counter() - began)
    alpha.close()
    beta.close()
    seen_s, unseen_s = statistics.median(seen), statistics.median(unseen)
    return {
        "rounds": rounds,
        "median_seen_s": round(seen_s, 3),
        "median_unseen_s": round(unseen_s, 3),
        "ratio_unseen_over_seen": round(unseen_s / seen_s, 2),
    }


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    variants = list(result["variants"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, key in zip(axes, ("p50_ms", "p99_ms"), strict=True):
        alone = [result["variants"][v]["alone"][key] for v in variants]
        loaded = [result["variants"][v]["during_registrations"][key] for v in variants]
        positions = range(len(variants))
        axis.bar([p - 0.2 for p in positions], alone, 0.4, label="alone")
        axis.bar([p + 0.2 for p in positions], loaded, 0.4, label="during registrations")
        axis.set_xticks(list(positions), variants)
        axis.set_ylabel(f"victim {key.replace('_ms', '')} (ms)")
        axis.legend()
    fig.suptitle("Victim latency while another tenant registers ~1 MiB-code modules")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(seconds: float, rounds: int, out: Path) -> dict[str, Any]:
    heavy = heavy_module("noisy_register")
    result: dict[str, Any] = {
        "benchmark": "registration",
        "module_bytes": len(heavy),
        "seconds_per_phase": seconds,
        "variants": {},
    }
    with tempfile.TemporaryDirectory(prefix="evald-bench-") as tmp:
        for variant, prefix in (
            ("in-process", [sys.executable, "-c", _IN_PROCESS]),
            ("worker-process", []),
        ):
            daemon: DaemonProcess = start_daemon(Path(tmp) / variant, _config(), prefix=prefix)
            try:
                result["variants"][variant] = _neighbour(daemon, seconds, heavy)
                if variant == "worker-process":
                    result["oracle"] = _oracle(daemon, rounds, heavy)
            finally:
                daemon.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "registration.json").write_text(json.dumps(result, indent=2) + "\n")
    result["plot"] = _plot(result, out / "registration.png")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``evald bench registration``."""
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--rounds", type=int, default=5, help="oracle rounds")
    parser.add_argument("--out", type=Path, default=Path("reports/bench"))


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    result = run(args.seconds, args.rounds, args.out)
    for variant, figures in result["variants"].items():
        print(
            f"{variant:>15}: victim p50 {figures['alone']['p50_ms']} -> "
            f"{figures['during_registrations']['p50_ms']} ms (x{figures['ratio_p50']}), "
            f"p99 {figures['alone']['p99_ms']} -> {figures['during_registrations']['p99_ms']} "
            f"ms (x{figures['ratio_p99']}); {figures['registrations']} registrations, median "
            f"{figures['median_registration_s']} s"
        )
    oracle = result["oracle"]
    print(
        f"oracle: bytes another tenant uploaded {oracle['median_seen_s']} s, unseen "
        f"{oracle['median_unseen_s']} s (x{oracle['ratio_unseen_over_seen']})"
    )
    return 0
