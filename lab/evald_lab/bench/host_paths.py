"""Overhead of the wasm host's call paths (a measurement script, not a test).

    evald bench host [--json FILE] [--quick] [--languages-only] [--table FILE]

Prints the best-of-N mean per call, in microseconds, for: wasmtime-py's ``Func.__call__``; the
raw ctypes path; one evaluation through ``WasmHost.evaluate`` (reused instance, fresh instance
with the default and the pooling allocator, with and without signal-based traps); compile vs
cached load; two threads against one; and the same evaluator in each guest language (checksum
in Zig, Rust and AssemblyScript: :mod:`evald_lab.bench.languages`, one table). Numbers are
machine-dependent: compare ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import wasmtime

from evald.host import HostConfig, Limits, WasmHost

# The raw ctypes call path is what part 1 times against wasmtime-py's, below the host's API.
from evald.host import _fastcall as fast
from evald.testing import arg, guest
from evald_lab.bench import languages
from evaluators_wasm import wasm_path

EXPRESSION = b"17 * 23 + 91 - (48 / 6) ** 2 % 7"  # 31 bytes of calc input


def best_us(run: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 200)):
        run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``evald bench host``."""
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--languages-only",
        action="store_true",
        help="measure only the guest languages' table (checksum in Zig, Rust, AssemblyScript)",
    )
    parser.add_argument(
        "--table", type=Path, help="also write the languages' table (Markdown) to this file"
    )


def main(options: argparse.Namespace) -> int:
    """Runs the benchmark; returns the exit status (2: it could not run)."""
    calls, repeats = (500, 3) if options.quick else (3000, 7)
    results: dict[str, Any] = {}
    if options.languages_only:
        return _languages(options, results)

    def record(name: str, value: float) -> None:
        results[name] = round(value, 2)
        print(f"{name:<58} {value:>10.2f}", flush=True)

    # 1. the two call paths on a trivial function
    with WasmHost() as host:
        engine = host._engine
        store = wasmtime.Store(engine)
        store.set_fuel(2**62)
        store.set_epoch_deadline(2**40)
        module = wasmtime.Module(
            engine,
            bytes(
                wasmtime.wat2wasm(
                    '(module (func (export "f") (param i32) (result i32) '
                    "(i32.add (local.get 0) (i32.const 1))))"
                )
            ),
        )
        instance = wasmtime.Instance(store, module, [])
        func = instance.exports(store)["f"]
        assert isinstance(func, wasmtime.Func)
        record("Func.__call__ (wasmtime-py), us", best_us(lambda: func(store, 1), calls, repeats))
        raw = fast.RawFunc.bind(store, func, params=1, results=1)
        record("raw ctypes call (RawFunc.call1), us", best_us(lambda: raw.call1(1), calls, repeats))
        context = fast.RawStore(store)

        def reset() -> None:
            context.set_fuel(1000)
            context.set_epoch_deadline(100)
            context.fuel()

        record("fuel set + deadline set + fuel read, us", best_us(reset, calls, repeats))

    calc_path = wasm_path("calc")
    calc_wasm = calc_path.read_bytes() if calc_path.exists() else None
    echo_wasm = guest("echo")

    # 2. one evaluation through the host, per isolation mode / allocator / trap mechanism
    limits = Limits()
    for label, config in [
        ("reuse", HostConfig()),
        ("reuse, signal-based traps", HostConfig(signals_based_traps=True)),
        ("fresh, default allocator", HostConfig(isolation="fresh", allocator="default")),
        ("fresh, pooling allocator", HostConfig(isolation="fresh", allocator="pooling")),
    ]:
        with WasmHost(config) as host:
            fresh = config.isolation == "fresh"
            n = calls // 10 if fresh else calls
            echo = host.load(echo_wasm)
            record(
                f"eval echo 31 B, {label}, us",
                best_us(functools.partial(host.evaluate, echo, EXPRESSION, limits), n, repeats),
            )
            if calc_wasm is not None:
                calc = host.load(calc_wasm)
                assert host.evaluate(calc, EXPRESSION, limits).ok
                record(
                    f"eval calc 31 B, {label}, us",
                    best_us(functools.partial(host.evaluate, calc, EXPRESSION, limits), n, repeats),
                )
                heavy = b"2 ** 3000 / 7 + 1"
                record(
                    f"eval calc 2**3000/7 (guest-heavy), {label}, us",
                    best_us(
                        functools.partial(host.evaluate, calc, heavy, limits), n // 10, repeats
                    ),
                )

    # 3. compile vs the disk cache
    wasm = calc_wasm or echo_wasm
    with tempfile.TemporaryDirectory() as tmp:
        timings = []
        for _ in range(2):
            with WasmHost(HostConfig(cache_dir=Path(tmp))) as host:
                started = time.perf_counter()
                loaded = host.load(wasm)
                timings.append((time.perf_counter() - started) * 1e3)
                assert loaded.from_cache == (len(timings) == 2)
        record(f"load {'calc' if calc_wasm else 'echo'} compiling (incl. rewrite), ms", timings[0])
        record(f"load {'calc' if calc_wasm else 'echo'} from the disk cache, ms", timings[1])

    # 4. two threads at once (the call releases the GIL)
    with WasmHost() as host:
        burn = host.load(guest("burn"))
        data = arg(2_000_000)
        per_thread = 5 if options.quick else 20

        def worker() -> None:
            for _ in range(per_thread):
                assert host.evaluate(burn, data, Limits(fuel=0, deadline_ms=60_000)).ok

        for threads in (1, 2):
            started = time.perf_counter()
            pool = [threading.Thread(target=worker) for _ in range(threads)]
            for thread in pool:
                thread.start()
            for thread in pool:
                thread.join()
            elapsed = time.perf_counter() - started
            record(
                f"burn 2M iterations, {threads} thread(s), evaluations/s",
                threads * per_thread / elapsed,
            )

    return _languages(options, results)


def _languages(options: argparse.Namespace, results: dict[str, Any]) -> int:
    """5. the same evaluator in each guest language; then the results file."""
    rows = languages.compare_languages(quick=options.quick)
    table = languages.markdown_table(rows)
    print(table, end="", flush=True)
    results["languages"] = languages.as_json(rows)
    if options.table:
        options.table.write_text(table)
    if options.json:
        options.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0
