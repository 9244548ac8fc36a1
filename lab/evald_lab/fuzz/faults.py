"""Faults: kill -9 of the daemon under load, and a full disk under the module store.

**kill -9 under load.** Load threads send victim batches with a per-call deadline; the daemon is
killed with SIGKILL, left down for a moment and restarted on the same state folder and socket.
Every call that was in flight or sent while it was down must fail with ``unavailable`` (the
client's "not reached") within its deadline plus the margin; every load thread must succeed again
after the restart (a client reconnects with a new channel); and every module registered before
the kill is listed, with the same hash, and callable afterwards.

**Full disk.** A second daemon whose state folder is a real 1 MiB tmpfs (``mount -t tmpfs``,
when the run may mount; otherwise the daemon runs under ``ulimit -f``, a per-file size limit that
makes the kernel refuse writes with EFBIG: a stand-in for a full disk, reported as such).
Registrations that do not fit — the module write failing, and (tmpfs only) the module fitting
but the tenant index not — must be refused with ``unavailable`` and leave nothing behind: no
temporary file, no orphan module, the index unchanged, the daemon serving. After space returns,
registration works and survives a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evald.client import CallError, Client
from evald.contract import pb
from evald.daemon import hash_token
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext
from evald_lab.harness import DaemonProcess, padded, start_daemon
from evald_lab.wat_corpus import guest, manifest_bytes

__all__ = ["disk_full", "kill_under_load"]

_KILL = "fault_kill9"
_DISK = "fault_disk_full"
_PAGE = 4096


def _owned(client: Client, tenant: str) -> set[tuple[str, str]]:
    return {(info.name, info.sha256) for info in client.list_evaluators() if info.owner == tenant}


def kill_under_load(
    ctx: FuzzContext,
    *,
    kill: Callable[[], None],
    restart: Callable[[], None],
    call_deadline_s: float = 2.0,
    loaders: int = 3,
    down_s: float = 0.5,
) -> dict[str, Any]:
    """kill -9 under load; returns the report section (violations go to the recorder)."""
    before = {t: _owned(ctx.client(t), t) for t in (ctx.victim, ctx.attacker)}
    margin_s = ctx.margin_ms / 1000
    lock = threading.Lock()
    failures: list[tuple[float, str]] = []  # (seconds the failed call took, code)
    successes_after: dict[int, float] = {}
    calls = {"before_kill": 0, "failed": 0, "after_restart": 0}
    killed_at = [0.0]
    up_at = [0.0]
    stop = threading.Event()

    def load(index: int) -> None:
        client = Client(ctx.target, ctx.tokens[ctx.victim], timeout_s=call_deadline_s)
        items = [
            pb.EvaluateRequest(evaluator="calc", input=f"{index}+{i}".encode(), id=str(i))
            for i in range(64)
        ]
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    response = client._invoke(
                        client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=items)
                    )
                except CallError as error:
                    took = time.monotonic() - started
                    code = error.code.value if error.code is not None else "unavailable"
                    with lock:
                        calls["failed"] += 1
                        failures.append((took, code))
                    ctx.recorder.outcome(_KILL, f"call:{code}", family="load")
                    client.close()  # reconnect with a fresh channel (no backoff carried over)
                    client = Client(ctx.target, ctx.tokens[ctx.victim], timeout_s=call_deadline_s)
                    time.sleep(0.02)
                    continue
                finished = time.monotonic()
                with lock:
                    if killed_at[0] == 0.0:
                        calls["before_kill"] += 1
                    elif up_at[0] and started >= up_at[0]:
                        calls["after_restart"] += 1
                        successes_after.setdefault(index, finished - up_at[0])
                violations, matched = ctx.checker.batch(
                    _KILL, ctx.victim, items, list(response.results), ordered=True
                )
                ctx.settle(_KILL, ctx.victim, violations, zip(items, matched, strict=True))
                for result in response.results:
                    ctx.recorder.outcome(_KILL, outcome_label(result), family="load")
        finally:
            client.close()

    threads = [
        threading.Thread(target=load, args=(i,), name=f"fuzz-load-{i}", daemon=True)
        for i in range(loaders)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    killed_at[0] = time.monotonic()
    kill()
    time.sleep(down_s)
    restart_started = time.monotonic()
    restart()
    up_at[0] = time.monotonic()
    give_up = up_at[0] + 30.0
    while time.monotonic() < give_up and len(successes_after) < loaders:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)

    violations: list[Violation] = []
    slow = [took for took, _ in failures if took > call_deadline_s + margin_s]
    if slow:
        violations.append(
            Violation(
                "fault",
                _KILL,
                f"{len(slow)} calls failed only after {max(slow):.2f} s, past their deadline "
                f"of {call_deadline_s:g} s + margin",
            )
        )
    codes: dict[str, int] = {}
    for _, code in failures:
        codes[code] = codes.get(code, 0) + 1
    wrong = {code: n for code, n in codes.items() if code != "unavailable"}
    if wrong:
        violations.append(Violation("fault", _KILL, f"calls failed with {wrong}, not unavailable"))
    if not failures:
        violations.append(
            Violation("fault", _KILL, "no call failed: the kill did not land under load")
        )
    if len(successes_after) < loaders:
        violations.append(
            Violation(
                "fault",
                _KILL,
                f"{loaders - len(successes_after)} of {loaders} clients did not recover in 30 s",
            )
        )
    after = {t: _owned(ctx.client(t), t) for t in (ctx.victim, ctx.attacker)}
    lost = {
        t: sorted(name for name, _ in before[t] - after[t]) for t in before if before[t] - after[t]
    }
    if lost:
        violations.append(Violation("fault", _KILL, f"modules lost across kill -9: {lost}"))
    canary = f"{ctx.secrets.victim_canary}-after-restart".encode()
    echo = ctx.client(ctx.victim).evaluate(ctx.secrets.victim_echo, canary)
    if outcome_label(echo) != "ok" or echo.value.encode() != canary:
        violations.append(
            Violation("fault", _KILL, "the victim's module does not answer after restart")
        )
    ctx.recorder.add(violations)
    return {
        "loaders": loaders,
        "call_deadline_s": call_deadline_s,
        "calls_before_kill": calls["before_kill"],
        "calls_failed": calls["failed"],
        "failure_codes": codes,
        "max_failure_latency_ms": round(max((took for took, _ in failures), default=0.0) * 1000, 1),
        "down_s": round(restart_started - killed_at[0], 3),
        "restart_s": round(up_at[0] - restart_started, 3),
        "recovered_after_ms": round(max(successes_after.values(), default=float("nan")) * 1000, 1),
        "calls_after_restart": calls["after_restart"],
        "modules_before": sum(len(v) for v in before.values()),
        "modules_after": sum(len(v) for v in after.values()),
        "modules_persisted": not lost,
    }


# -- full disk ----------------------------------------------------------------------------------


def _store_files(state: Path) -> dict[str, int]:
    files: dict[str, int] = {}
    for folder in ("modules", "tenants"):
        root = state / folder
        if root.is_dir():
            for path in root.iterdir():
                files[f"{folder}/{path.name}"] = path.stat().st_size
    return files


def _index(state: Path, tenant: str) -> dict[str, Any]:
    path = state / "tenants" / f"{tenant}.json"
    return json.loads(path.read_text())["modules"] if path.exists() else {}


def _fill(mount: Path, leave_bytes: int) -> Path:
    """Writes a filler file so that about ``leave_bytes`` stay free (page granularity)."""
    filler = mount / "filler"
    stats = os.statvfs(mount)
    free = stats.f_bavail * stats.f_frsize
    size = max(0, free - leave_bytes)
    with open(filler, "wb") as out:
        chunk = b"\0" * (1 << 16)
        remaining = size
        try:
            while remaining > 0:
                written = out.write(chunk[: min(len(chunk), remaining)])
                remaining -= written
            out.flush()
        except OSError:
            pass
    return filler


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def _module(name: str, total_bytes: int | None = None) -> bytes:
    wasm = guest(
        "echo", manifest=manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    )
    return padded(wasm, total_bytes) if total_bytes else wasm


def disk_full(root: Path, *, margin_ms: float) -> tuple[dict[str, Any], list[Violation]]:
    """The full-disk scenario on its own daemon under ``root``; returns (report, violations)."""
    del margin_ms
    violations: list[Violation] = []
    outcomes: list[dict[str, Any]] = []
    store = root / "store"
    store.mkdir(parents=True, exist_ok=True)
    mounted = _mount_tmpfs(store, "1m")
    token = f"disk-{os.urandom(16).hex()}"
    config = "\n".join(
        [
            "[server]",
            "threads = 1",
            'log_level = "warning"',
            "shutdown_grace_s = 5",
            "[host]",
            f'cache_dir = "{root / "cache"}"',
            "[[tenants]]",
            'name = "tenant"',
            f'token_sha256 = "{hash_token(token)}"',
            "allow_register = true",
            "max_modules = 16",
        ]
    )
    prefix: list[str] = [] if mounted else ["bash", "-c", 'ulimit -f 512 && exec "$0" "$@"']
    method = "tmpfs size=1m (mount -t tmpfs)" if mounted else "fake: ulimit -f 512 (EFBIG per file)"
    daemon: DaemonProcess | None = None

    def start() -> DaemonProcess:
        return start_daemon(
            root, config, state_dir=store, socket_path=root / "d.sock", prefix=prefix
        )

    def expect_refusal(label: str, wasm: bytes, client: Client) -> None:
        before_files = _store_files(store)
        before_index = _index(store, "tenant")
        try:
            client.register(wasm)
        except CallError as error:
            code = error.code.value if error.code is not None else "unreachable"
            outcomes.append({"case": label, "outcome": code, "message": error.message[:200]})
            if code != "unavailable":
                violations.append(
                    Violation(
                        "fault",
                        _DISK,
                        f"{label}: refused with {code}, not unavailable: {error.message[:120]}",
                    )
                )
        else:
            outcomes.append({"case": label, "outcome": "registered"})
            violations.append(
                Violation("fault", _DISK, f"{label}: registered although the store is full")
            )
            return
        after_files = _store_files(store)
        leftovers = sorted(set(after_files) - set(before_files))
        if leftovers:
            violations.append(Violation("fault", _DISK, f"{label}: files left behind: {leftovers}"))
        if _index(store, "tenant") != before_index:
            violations.append(Violation("fault", _DISK, f"{label}: the tenant index changed"))

    def expect_serving(client: Client, names: list[str]) -> None:
        for name in names:
            response = client.evaluate(name, b"still here")
            if outcome_label(response) != "ok" or response.value != "still here":
                violations.append(
                    Violation("fault", _DISK, f"{name} does not answer after the full disk")
                )

    filler: Path | None = None
    try:
        daemon = start()
        client = Client(daemon.target, token, timeout_s=60)
        client.register(_module("disk_a"))
        outcomes.append({"case": "fits", "outcome": "registered"})
        if mounted:
            big = _module("disk_b", 300 * 1024)
            filler = _fill(store, 0)
            expect_refusal("module_write_fails", big, client)
            filler.unlink()
            # room for the module's pages but not for the new index
            filler = _fill(store, -(-len(big) // _PAGE) * _PAGE)
            expect_refusal("index_write_fails", big, client)
            filler.unlink()
            filler = None
        else:
            big = _module("disk_b", 600 * 1024)
            expect_refusal("module_write_fails", big, client)
            big = _module("disk_b", 100 * 1024)
        expect_serving(client, ["disk_a"])
        client.register(big)
        outcomes.append({"case": "space_back", "outcome": "registered"})
        client.close()
        daemon.stop(signal.SIGTERM)
        daemon = start()
        client = Client(daemon.target, token, timeout_s=60)
        names = sorted(info.name for info in client.list_evaluators() if info.owner == "tenant")
        if names != ["disk_a", "disk_b"]:
            violations.append(Violation("fault", _DISK, f"after restart the tenant has {names}"))
        expect_serving(client, ["disk_a", "disk_b"])
        client.close()
    except (CallError, RuntimeError, OSError) as error:
        violations.append(Violation("fault", _DISK, f"the full-disk scenario failed: {error}"))
    finally:
        if daemon is not None and daemon.alive():
            with contextlib.suppress(Exception):
                daemon.stop(signal.SIGTERM, timeout_s=30)
        if filler is not None:
            filler.unlink(missing_ok=True)
        if mounted:
            subprocess.run(["umount", str(store)], capture_output=True, check=False)
    return {"method": method, "cases": outcomes, "passed": not violations}, violations
