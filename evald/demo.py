"""``python -m evald.demo`` (what ``make run`` shows): the daemon end to end on this machine.

Starts ``evald serve`` with the packaged default config on a temporary unix socket, waits until
it is healthy, runs a few evaluations through ``evald call`` exactly as a person or a script
would, prints them in a table, and stops the daemon with SIGTERM (a graceful drain).

Each part of the demo is a *section*: a function ``(target, console) -> None`` run while the
daemon serves. Later parts (the model demo) append theirs to :data:`SECTIONS`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evald._client import CallError, Client
from evald._config import DEFAULT_CONFIG_PATH

__all__ = ["EXAMPLES", "SECTIONS", "evald_command", "main", "running_daemon", "show_evaluations"]

#: (evaluator, span content) pairs; an evaluator the daemon does not serve is skipped.
EXAMPLES: tuple[tuple[str, str], ...] = (
    ("calc", "17 * 23 + 91"),
    ("calc", "(2 ** 64) / 3"),
    ("strop", 'count("strawberry", "r")'),
    ("date", "2024-02-28 + 2 days"),
    ("units", "12.5 km to mi"),
    ("checksum", 'crc32("hello")'),
    ("calc", "1 / 0"),
)

Section = Callable[[str, Console], None]


def evald_command() -> list[str]:
    """How to run the ``evald`` console script from this interpreter's environment."""
    script = Path(sys.executable).with_name("evald")
    if script.exists():
        return [str(script)]
    found = shutil.which("evald")
    return [found] if found else [sys.executable, "-m", "evald.cli"]


@contextmanager
def running_daemon(workdir: Path, console: Console) -> Iterator[str]:
    """Runs ``evald serve`` (default config) on a socket in ``workdir``; yields its target."""
    socket_path = workdir / "evald.sock"
    target = f"unix:{socket_path}"
    log_path = workdir / "daemon.log"
    command = [
        *evald_command(),
        "serve",
        "--config",
        str(DEFAULT_CONFIG_PATH),
        "--listen",
        target,
        "--state-dir",
        str(workdir / "state"),
    ]
    console.print(f"[bold]starting[/] evald {' '.join(command[-7:])}")
    started = time.perf_counter()
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(process, target, log_path)
        console.print(
            f"[green]serving[/] on {target} after {time.perf_counter() - started:.1f} s "
            f"(pid {process.pid}; JSON log in {log_path.name})"
        )
        yield target
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                status = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
            console.print(f"[bold]stopped[/] the daemon with SIGTERM (exit status {status})")


def _wait_healthy(process: subprocess.Popen[bytes], target: str, log_path: Path) -> None:
    give_up = time.monotonic() + 60
    with Client(target, timeout_s=2.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"evald serve exited with status {process.returncode}:\n"
                    + log_path.read_text(errors="replace")
                )
            try:
                if client.health() == "SERVING":
                    return
            except CallError:
                pass
            if time.monotonic() > give_up:
                raise RuntimeError("evald serve did not become healthy within 60 s")
            time.sleep(0.05)


@dataclass(frozen=True)
class _Row:
    evaluator: str
    content: str
    status: int
    output: str
    wall_ms: float


def show_evaluations(target: str, console: Console) -> None:
    """Runs :data:`EXAMPLES` through ``evald call`` and prints what each printed and took."""
    with Client(target) as client:
        served = {info.name for info in client.list_evaluators()}
    console.print(f"evaluators served: {', '.join(sorted(served)) or '(none)'}")
    examples = [(name, content) for name, content in EXAMPLES if name in served]
    skipped = sorted({name for name, _ in EXAMPLES} - served)
    rows: list[_Row] = []
    env = {**os.environ, "EVALD_TARGET": target}
    for name, content in examples:
        started = time.perf_counter()
        result = subprocess.run(
            [*evald_command(), "call", name, "--", content],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        wall_ms = (time.perf_counter() - started) * 1000
        output = (result.stdout if result.returncode == 0 else result.stderr).strip()
        rows.append(_Row(name, content, result.returncode, output, wall_ms))
    with Client(target) as client:
        client.evaluate_batch(examples)  # warm: each worker thread instantiates once
        inside = client.evaluate_batch(examples)
    table = Table(title="evald call TAG INPUT")
    for column in ("span", "printed", "exit", "evald call ms", "in daemon µs (warm)", "fuel"):
        table.add_column(column, overflow="fold")
    for row, response in zip(rows, inside, strict=True):
        style = "green" if row.status == 0 else "yellow"
        table.add_row(
            f"<{row.evaluator}>{row.content}</{row.evaluator}>",
            f"[{style}]{row.output}[/]",
            str(row.status),
            f"{row.wall_ms:.0f}",
            str(response.eval_time_us),
            str(response.fuel_used),
        )
    console.print(table)
    console.print(
        "[dim]`evald call ms` includes starting the CLI process; `in daemon µs` is the "
        "evaluation alone as the daemon reports it, on an already instantiated module.[/]"
    )
    if skipped:
        console.print(f"[dim]skipped (not built): {', '.join(skipped)}[/]")


#: What the demo shows while the daemon serves, in order.
SECTIONS: list[Section] = [show_evaluations]


def main() -> int:
    """Runs every section against a fresh daemon; returns the exit status."""
    console = Console()
    with tempfile.TemporaryDirectory(prefix="evald-demo-") as tmp:
        with running_daemon(Path(tmp), console) as target:
            for section in SECTIONS:
                section(target, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
