"""``evald bench profile``: where one evaluation's time goes, in the host and in the daemon.

Two measurements, both in CPU time (steady on a shared machine, where wall time mostly says how
busy the neighbours are):

* **host** — one ``WasmHost.evaluate`` on a reused instance (short calc input), and each of its
  parts timed alone, best of several runs: the guest call, the input write, the output read,
  the buffer zeroing (copies through the memory view), the fuel, epoch-deadline and memory-size
  calls, the deadline computation and the outcome object. What is left is the host's Python
  glue. The parts are reached through the host's private instance on purpose: this is a
  profile of exactly that code.
* **daemon** — ``evald serve`` answering 64-item messages on its unix socket in a closed loop,
  once as gRPC ``EvaluateBatch`` and once on the data path: CPU per item of each of its threads
  (event loop, guest workers, data-path readers, epoch ticker, gRPC), from ``/proc``; thread
  names from ``py-spy dump``. With py-spy, also a sampled profile of what holds the GIL (the
  daemon's Python code runs under one lock, so that is its ceiling).

py-spy is optional (``pip install py-spy``, in the ``bench`` extra); without it threads are
named by id and the GIL profile is skipped.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evald_lab.bench._common import (
    DEFAULT_OUT_DIR,
    SCHEMA_VERSION,
    cpu_seconds_of,
    load_average,
    machine_info,
    write_json,
)

__all__ = [
    "PROFILES",
    "daemon_breakdown",
    "fresh_breakdown",
    "fresh_markdown",
    "host_breakdown",
    "profile_markdown",
    "run_profile",
]

_DATA = b"17 * 23 + 91"


def _best_cpu_us(run: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 500)):
        run()
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time_ns()
        for _ in range(calls):
            run()
        best = min(best, (time.thread_time_ns() - started) / calls / 1000)
    return round(best, 2)


def host_breakdown(calls: int = 5000, repeats: int = 7) -> dict[str, Any]:
    """CPU µs of one reused-instance evaluation and of each of its parts (see the module doc)."""
    from evald.host import EvalOutcome, HostConfig, Limits, WasmHost
    from evaluators_wasm import wasm_path

    host = WasmHost(HostConfig(isolation="reuse"))
    try:
        module = host.load(wasm_path("calc").read_bytes())
        limits = Limits()
        assert host.evaluate(module, _DATA, limits).value == "482"
        instance = host._pool.instances()[("", module.sha256)]
        memory, context, function = instance.memory, instance.context, instance.eval
        size = len(_DATA)
        view, in_ptr, out_ptr = instance.view, instance.in_ptr, instance.out_ptr

        def write() -> None:
            view[in_ptr : in_ptr + size] = _DATA

        def guest() -> None:
            view[in_ptr : in_ptr + size] = _DATA
            context.set_fuel(limits.fuel)
            context.set_epoch_deadline(1000)
            function.call1(size)

        parts = {
            "evaluate (whole)": _best_cpu_us(
                lambda: host.evaluate(module, _DATA, limits), calls, repeats
            ),
            "input write (memory view)": _best_cpu_us(write, calls, repeats),
            "set fuel": _best_cpu_us(lambda: context.set_fuel(limits.fuel), calls, repeats),
            "set epoch deadline": _best_cpu_us(
                lambda: context.set_epoch_deadline(1000), calls, repeats
            ),
            "read fuel": _best_cpu_us(context.fuel, calls, repeats),
            "deadline in ticks (ticker lag)": _best_cpu_us(
                lambda: host._deadlines.ticks(limits.deadline_ms), calls, repeats
            ),
            "memory size (grown since the view?)": _best_cpu_us(memory.size, calls, repeats),
            "output read (decode from the view)": _best_cpu_us(
                lambda: str(view[out_ptr : out_ptr + 3], "utf-8"), calls, repeats
            ),
            "zero both buffers": _best_cpu_us(
                lambda: instance.clear_buffers(size, 3), calls, repeats
            ),
            "outcome object": _best_cpu_us(
                lambda: EvalOutcome("482", None, "", 1, 1), calls, repeats
            ),
        }
        with_call = _best_cpu_us(guest, calls, repeats)
    finally:
        host.close()
    # The guest call alone: the write/fuel/deadline it needs are timed separately above.
    parts["guest call (ctypes, GIL released)"] = round(
        with_call
        - parts["input write (memory view)"]
        - parts["set fuel"]
        - parts["set epoch deadline"],
        2,
    )
    named = sum(value for key, value in parts.items() if key != "evaluate (whole)")
    parts["python glue (the rest)"] = round(parts["evaluate (whole)"] - named, 2)
    return {"input": _DATA.decode(), "cpu_us": parts}


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fresh_breakdown(calls: int = 3000, evaluator: str = "calc") -> dict[str, Any]:
    """Where a fresh-isolation evaluation's time goes, two ways, median µs (wall) of each part:

    * ``per_call``: a new store and instance for the call, step by step as
      :func:`evald.host._instance.instantiate` makes it (store and its limits, instantiation,
      export lookups and bindings, the buffers' bounds), the call itself (its first touches of
      the memory fault pages in) and the store's end (its memory handed back);
    * ``kept``: the instance kept and put back after the call (``Instance.reset``), split
      into the call and the reset; absent where the host cannot reset (a host without it).

    Page faults per evaluation come from ``getrusage``. The parts are reached through the
    host's private modules on purpose: this is a profile of exactly that code, and it runs
    against an older host too (``_pre`` and ``reset`` are looked up, not assumed).
    """
    import gc
    import statistics

    import wasmtime

    from evald.host import HostConfig, Limits, WasmHost, _instance
    from evald.host import _fastcall as fast
    from evaluators_wasm import wasm_path

    data = _DATA if evaluator == "calc" else b'count("strawberry", "r")'
    clock = time.perf_counter_ns
    limits = Limits()
    host = WasmHost(HostConfig(isolation="fresh"))
    try:
        module = host.load(wasm_path(evaluator).read_bytes())
        engine, ticks = host._engine, host._deadlines.ticks(limits.deadline_ms)
        cap = host.memory_cap(limits)
        linked = module.pre
        parts: dict[str, list[int]] = collections.defaultdict(list)
        faults = _minor_faults()
        for index in range(calls):
            if index % 64 == 0:
                gc.collect()  # a dropped store in a reference cycle keeps its pool slot
            t0 = clock()
            store = wasmtime.Store(engine)
            store.set_limits(
                memory_size=cap,
                table_elements=_instance.MAX_TABLE_ELEMENTS,
                tables=_instance.MAX_TABLES,
            )
            instance = _instance.Instance(module, store, cap)
            instance.context.set_fuel(limits.fuel)
            instance.context.set_epoch_deadline(ticks)
            t1 = clock()
            wasm_instance = fast.instantiate(store, linked)
            t2 = clock()
            memory = fast.export(store, wasm_instance, "memory")
            assert isinstance(memory, wasmtime.Memory)
            instance.memory = fast.RawMemory(store, memory)
            instance.eval = _instance.bind_function(store, wasm_instance, module.eval_export, 1)
            if module.flag_export is not None:
                fast.export(store, wasm_instance, module.flag_export)
            t3 = clock()
            trial = module.trial
            instance.place_buffers(
                trial.input_ptr, trial.input_cap, trial.output_ptr, trial.output_cap
            )
            t4 = clock()
            view, in_ptr = instance.view, instance.in_ptr
            view[in_ptr : in_ptr + len(data)] = data
            instance.context.set_fuel(limits.fuel)
            instance.context.set_epoch_deadline(ticks)
            instance.eval.call1(len(data))
            t5 = clock()
            del instance, wasm_instance, memory, view, store
            t6 = clock()
            for name, spent in (
                ("new store, its limits, fuel and deadline", t1 - t0),
                ("instantiation", t2 - t1),
                ("export lookups and raw bindings", t3 - t2),
                ("buffers' bounds (memory view)", t4 - t3),
                ("the call (input, fuel, deadline, guest; first touches fault)", t5 - t4),
                ("the store's end (memory handed back)", t6 - t5),
                ("total", t6 - t0),
            ):
                parts[name].append(spent)
        per_call_faults = (_minor_faults() - faults) / calls
        whole = []
        for _ in range(calls):
            t0 = clock()
            host.evaluate(module, data, limits)
            whole.append(clock() - t0)
        result: dict[str, Any] = {
            "evaluator": evaluator,
            "input": data.decode(),
            "per_call": {name: round(statistics.median(v) / 1000, 2) for name, v in parts.items()},
            "per_call_faults_per_eval": round(per_call_faults, 2),
            "evaluate_p50_us": round(statistics.median(whole) / 1000, 2),
        }
        kept = host._pool.instances().get(("", module.sha256))
        if kept is not None and getattr(kept, "reset", None) is not None:
            split: dict[str, list[int]] = collections.defaultdict(list)
            faults = _minor_faults()
            view, in_ptr = kept.view, kept.in_ptr
            for _ in range(calls):
                t0 = clock()
                view[in_ptr : in_ptr + len(data)] = data
                kept.context.set_fuel(limits.fuel)
                kept.context.set_epoch_deadline(ticks)
                kept.eval.call1(len(data))
                kept.context.fuel()
                kept.memory.size()
                t1 = clock()
                assert kept.reset()
                t2 = clock()
                split["the call (input, fuel, deadline, guest, fuel and size read)"].append(t1 - t0)
                split["the reset (page scan, written pages back to the image)"].append(t2 - t1)
                split["total"].append(t2 - t0)
            result["kept"] = {
                name: round(statistics.median(v) / 1000, 2) for name, v in split.items()
            }
            result["kept_faults_per_eval"] = round((_minor_faults() - faults) / calls, 2)
        return result
    finally:
        host.close()


def _thread_cpu(pid: int) -> dict[int, float]:
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _thread_names(py_spy: str | None, pid: int) -> dict[int, str]:
    if py_spy is None:
        return {}
    try:
        done = subprocess.run(
            [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return {
        int(match.group(1)): match.group(2)
        for match in re.finditer(r'^Thread (\d+) \(\w+\): "([^"]*)"', done.stdout, re.M)
    }


def _gil_profile(raw: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive shares of the GIL-holding samples, by function."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples

    def share(n: int) -> float:
        return round(n / total * 100, 1) if total else 0.0

    return {
        "samples": total,
        "self_percent": {name: share(n) for name, n in own.most_common(top)},
        "inclusive_percent": {name: share(n) for name, n in inclusive.most_common(top)},
    }


def _data_path_batches(target: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one 64-item round trip on the data path, close)."""
    from evald.client import DataConnection
    from evald.contract import pb

    connection = DataConnection.connect(target)
    message = pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=_DATA, id=str(i)) for i in range(64)]
    )

    def round_trip() -> None:
        connection.send(message)
        got = 0
        while got < 64:
            response = connection.receive()
            if response is None:
                raise RuntimeError("the daemon closed the data-path connection")
            got += len(response.results)

    return round_trip, connection.close


def daemon_breakdown(
    duration_s: float = 10.0, *, gil_profile: bool = True, transport: str = "grpc"
) -> dict[str, Any]:
    """CPU µs per item of each daemon thread under 64-item messages (see above), over gRPC
    ``EvaluateBatch`` (``transport="grpc"``) or the data path (``"data"``)."""
    from evald.client import Client
    from evald.testing import start_daemon
    from evald_lab.bench._overhead import bench_daemon_config

    py_spy = _py_spy()
    with tempfile.TemporaryDirectory(prefix="evald-profile-") as tmp:
        data_target = f"unix:{Path(tmp) / 'data.sock'}"
        daemon: Any = start_daemon(Path(tmp), bench_daemon_config(data_listen=data_target))
        try:
            with Client(daemon.target) as client:
                items = [("calc", _DATA)] * 64
                if transport == "data":
                    round_trip, close = _data_path_batches(data_target)
                else:

                    def round_trip() -> None:
                        client.evaluate_batch(items)

                    def close() -> None:
                        pass

                for _ in range(30):
                    round_trip()
                done = threading.Event()
                count = [0]

                def load() -> None:
                    while not done.is_set():
                        round_trip()
                        count[0] += 64

                names = _thread_names(py_spy, daemon.pid)
                before = _thread_cpu(daemon.pid)
                daemon_before = cpu_seconds_of(daemon.pid) or 0.0
                client_before = time.process_time()
                started = time.perf_counter()
                driver = threading.Thread(target=load, daemon=True)
                driver.start()
                gil: dict[str, Any] | None = None
                if gil_profile and py_spy is not None:
                    raw = Path(tmp) / "gil.raw"
                    subprocess.run(
                        [py_spy, "record", "--pid", str(daemon.pid), "--duration",
                         str(max(1, int(duration_s))), "--rate", "200", "--gil", "--threads",
                         "--format", "raw", "--output", str(raw), "--nonblocking"],
                        capture_output=True, timeout=duration_s + 60,
                    )  # fmt: skip
                    if raw.exists():
                        gil = _gil_profile(raw)
                else:
                    time.sleep(duration_s)
                done.set()
                driver.join()
                wall = time.perf_counter() - started
                after = _thread_cpu(daemon.pid)  # before close(): its reader thread then ends
                daemon_cpu = (cpu_seconds_of(daemon.pid) or 0.0) - daemon_before
                client_cpu = time.process_time() - client_before
                close()
        finally:
            daemon.stop()
    n = max(1, count[0])
    by_name: dict[str, float] = collections.defaultdict(float)
    for tid, seconds in after.items():
        label = names.get(tid, "other native threads (gRPC core)")
        by_name[label] += seconds - before.get(tid, 0.0)
    return {
        "rpc": ("data path" if transport == "data" else "EvaluateBatch")
        + ", 64 x calc 17 * 23 + 91, unix socket, one closed-loop caller",
        "items": count[0],
        "items_per_s": round(count[0] / wall, 1),
        "daemon_cpu_us_per_item": round(daemon_cpu / n * 1e6, 2),
        "client_cpu_us_per_item": round(client_cpu / n * 1e6, 2),
        "thread_cpu_us_per_item": {
            name: round(seconds / n * 1e6, 2)
            for name, seconds in sorted(by_name.items(), key=lambda kv: -kv[1])
            if seconds > 0
        },
        "py_spy": py_spy is not None,
        "gil_profile": gil,
    }


def profile_markdown(document: dict[str, Any]) -> str:
    """The two breakdowns as Markdown tables."""
    lines = ["| host: one reused-instance evaluation (calc, 12 bytes) | CPU µs |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in document["host"]["cpu_us"].items()]
    for name, fresh in document.get("fresh", {}).items():
        lines += ["", *fresh_markdown(fresh, f"host: one fresh-isolation evaluation ({name})")]
    for key in ("daemon", "daemon_data_path"):
        daemon = document.get(key)
        if daemon is None:
            continue
        lines += [
            "",
            f"| daemon thread ({daemon['items_per_s']:,.0f} items/s, {daemon['rpc']}) "
            "| CPU µs/item |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v} |" for k, v in daemon["thread_cpu_us_per_item"].items()]
        lines.append(f"| **daemon total** | **{daemon['daemon_cpu_us_per_item']}** |")
        lines.append(f"| client (this process) | {daemon['client_cpu_us_per_item']} |")
        gil = daemon.get("gil_profile")
        if gil:
            lines += ["", "| holds the GIL (py-spy, self) | % of samples |", "|---|---|"]
            lines += [f"| `{k}` | {v} |" for k, v in list(gil["self_percent"].items())[:15]]
    return "\n".join(lines)


def fresh_markdown(fresh: dict[str, Any], title: str) -> list[str]:
    """One :func:`fresh_breakdown` as Markdown table lines."""
    lines = [f"| {title}: a new instance per call | µs (p50) |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in fresh["per_call"].items()]
    lines.append(f"| page faults per evaluation | {fresh['per_call_faults_per_eval']} |")
    if "kept" in fresh:
        lines += ["", f"| {title}: the kept instance, put back | µs (p50) |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in fresh["kept"].items()]
        lines.append(f"| page faults per evaluation | {fresh['kept_faults_per_eval']} |")
    lines.append(f"| `WasmHost.evaluate` as configured, whole | {fresh['evaluate_p50_us']} |")
    return lines


#: name -> (host calls per timing, repeats, daemon seconds)
PROFILES = {"tiny": (300, 2, 1.0), "full": (5000, 7, 10.0)}


def run_profile(
    profile: str = "full", *, out_dir: Path = DEFAULT_OUT_DIR, gil_profile: bool = True
) -> dict[str, Any]:
    """Runs both breakdowns; writes ``profile.json`` and ``profile.md`` under ``out_dir``.

    Raises:
        KeyError: an unknown profile name.
        RuntimeError: the daemon did not start (its log is in the message).
    """
    calls, repeats, duration_s = PROFILES[profile]
    machine = machine_info()
    document = {
        "benchmark": "profile",
        "schema": SCHEMA_VERSION,
        "profile": profile,
        "host": host_breakdown(calls, repeats),
        "fresh": {name: fresh_breakdown(calls, name) for name in ("calc", "strop")},
        "daemon": daemon_breakdown(duration_s, gil_profile=gil_profile),
        "daemon_data_path": daemon_breakdown(duration_s, gil_profile=gil_profile, transport="data"),
        "machine": {**machine, "load_average_at_end": load_average()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "profile.json", document)
    (out_dir / "profile.md").write_text(profile_markdown(document) + "\n", encoding="utf-8")
    return document
