"""A busy machine on demand: processes that loop on the CPU for a block.

A user's server is rarely quiet, and a scheduling bound that holds only on an idle machine is
not one: the real-server stall tests and the stall benchmarks run their measurement again
beside these (docs/sglang.md, "Where a plain request waits").
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["cpu_hogs"]


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` processes that busy-loop for the block, like ``yes > /dev/null &`` from the
    shell that runs the caller: they share its session (its scheduling group) and its nice
    value; killed and reaped at the block's end, however it ends."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield
    finally:
        for hog in started:
            hog.kill()
            hog.wait(timeout=10)
