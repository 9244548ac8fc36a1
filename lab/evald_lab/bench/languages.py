"""What the same evaluator costs in each guest language: part of ``evald bench host``.

The standard ``checksum`` module (Zig) and its ports (``evaluators_wasm/ports/``: Rust,
AssemblyScript) pass the same tests byte for byte, so their rows differ only by what their
compilers and guest libraries make of one program. Per language, through the host's public API
(:class:`evald.host.WasmHost`), measured side by side in one run:

* module bytes (manifest included) and compile time (``WasmHost.load`` without a disk cache:
  validation, compilation, trial instantiation; the median of a few loads);
* p50 wall time per call of a small span (``crc32("hello")``) on a reused instance and on a
  fresh one, each call timed alone;
* fuel (about one unit per wasm instruction) of the small span and of SHA-256 over 1 MiB;
* guest memory: the smallest tenant memory limit, in 64 KiB pages, under which every span of
  the run evaluates (a megabyte with and without escapes included).

:func:`compare_languages` returns the rows; :func:`markdown_table` renders them as the table
docs/writing-evaluators.md quotes. Numbers depend on the machine: compare the columns.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from evald.host import HostConfig, Limits, WasmHost
from evaluators_wasm import PORTS, port_path, wasm_path

__all__ = [
    "SPANS",
    "LanguageRow",
    "as_json",
    "compare_languages",
    "implementations",
    "markdown_table",
]

_CAP: Final = 1 << 20
_PAGE: Final = 64 * 1024
#: The spans of the run: the small one timed, the megabytes for fuel and memory.
SPANS: Final = {
    "small": b'crc32("hello")',
    "sha256 1 MiB": b'sha256("' + b"a" * (_CAP - 10) + b'")',
    "sha256 1 MiB escaped": b'sha256("' + b"\\u00e9" * ((_CAP - 10) // 6) + b'")',
}
_LANGUAGE_TITLES: Final = {"rust": "Rust", "assemblyscript": "AssemblyScript"}


@dataclass(frozen=True)
class LanguageRow:
    """One language's numbers (see the module docstring for how each is measured)."""

    language: str
    module: str
    module_bytes: int
    compile_ms: float
    p50_reused_us: float
    p50_fresh_us: float
    fuel_small: int
    fuel_sha256_1mib: int
    memory_pages: int


def implementations(standard: str = "checksum") -> list[tuple[str, str, Path]]:
    """(language title, module name, built module) of ``standard`` and each of its ports."""
    found = [("Zig", standard, wasm_path(standard))]
    for name, (of, language) in PORTS.items():
        if of == standard:
            found.append((_LANGUAGE_TITLES.get(language, language), name, port_path(name)))
    return found


def _p50_us(host: WasmHost, module: Any, data: bytes, limits: Limits, calls: int) -> float:
    for _ in range(min(calls, 100)):
        host.evaluate(module, data, limits)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        outcome = host.evaluate(module, data, limits)
        times.append(time.perf_counter() - started)
        assert outcome.ok, outcome.message
    return statistics.median(times) * 1e6


def _memory_pages(wasm: bytes, limits: Limits) -> int:
    """The fewest 64 KiB pages of memory limit under which every span evaluates."""
    with WasmHost(HostConfig(isolation="fresh")) as host:
        module = host.load(wasm, limits=limits)

        def fits(pages: int) -> bool:
            capped = Limits(fuel=limits.fuel, deadline_ms=limits.deadline_ms,
                            memory_bytes=pages * _PAGE)  # fmt: skip
            return all(host.evaluate(module, data, capped).ok for data in SPANS.values())

        low, high = 1, limits.memory_bytes // _PAGE
        assert fits(high), "the spans do not evaluate under the default memory limit"
        while low < high:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle + 1
        return low


def compare_languages(*, quick: bool = False) -> list[LanguageRow]:
    """Measures every implementation of checksum side by side (module docstring)."""
    calls = 300 if quick else 3000
    loads = 3 if quick else 7
    limits = Limits(deadline_ms=10_000)  # the default fuel and memory; wall time is measured
    rows = []
    for title, name, path in implementations():
        wasm = path.read_bytes()
        compile_ms = []
        for _ in range(loads):
            with WasmHost() as host:
                started = time.perf_counter()
                host.load(wasm, limits=limits)
                compile_ms.append((time.perf_counter() - started) * 1e3)
        with WasmHost(HostConfig(isolation="reuse")) as host:
            module = host.load(wasm, limits=limits)
            reused = _p50_us(host, module, SPANS["small"], limits, calls)
            fuel_small = host.evaluate(module, SPANS["small"], limits).fuel_used
            fuel_big = host.evaluate(module, SPANS["sha256 1 MiB"], limits).fuel_used
        with WasmHost(HostConfig(isolation="fresh")) as host:
            module = host.load(wasm, limits=limits)
            fresh = _p50_us(host, module, SPANS["small"], limits, max(calls // 10, 30))
        rows.append(
            LanguageRow(
                language=title,
                module=name,
                module_bytes=len(wasm),
                compile_ms=round(statistics.median(compile_ms), 2),
                p50_reused_us=round(reused, 2),
                p50_fresh_us=round(fresh, 2),
                fuel_small=fuel_small,
                fuel_sha256_1mib=fuel_big,
                memory_pages=_memory_pages(wasm, limits),
            )
        )
    return rows


def markdown_table(rows: list[LanguageRow]) -> str:
    """The rows as the Markdown table of docs/writing-evaluators.md, ratios to the first row."""
    base = rows[0]
    lines = [
        "| checksum in | module | compile | p50 per call, reused | p50 per call, fresh | "
        "fuel, small span | fuel, SHA-256 of 1 MiB | guest memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.language} | {row.module_bytes / 1024:.1f} KiB | {row.compile_ms:.1f} ms | "
            f"{row.p50_reused_us:.1f} µs ({row.p50_reused_us / base.p50_reused_us:.2f}x) | "
            f"{row.p50_fresh_us:.1f} µs ({row.p50_fresh_us / base.p50_fresh_us:.2f}x) | "
            f"{row.fuel_small:,} | {row.fuel_sha256_1mib / 1e6:.1f} M "
            f"({row.fuel_sha256_1mib / base.fuel_sha256_1mib:.2f}x) | "
            f"{row.memory_pages * 64} KiB |"
        )
    return "\n".join(lines) + "\n"


def as_json(rows: list[LanguageRow]) -> list[dict[str, Any]]:
    """The rows as JSON objects (the results file's ``languages``)."""
    return [asdict(row) for row in rows]
