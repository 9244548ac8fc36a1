"""Kills a parent process with SIGKILL and checks that the child it started dies with it.

The product's daemon starter (:func:`evald.testing.start_daemon`) and the lab's (the demo, the
GPU check's runner) are each checked by starting a real parent that starts a real child, then
killing the parent so that no clean-up code of it runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

__all__ = ["GONE_WITHIN_S", "kill_parent_and_check", "run_parent"]

#: Generous: the daemon drains (nothing is in flight) and exits in well under a second.
GONE_WITHIN_S = 20.0


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = GONE_WITHIN_S) -> bool:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def run_parent(script: str, tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """Starts ``script`` as the parent; returns it and the child pid it prints."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    if not line.strip().isdigit():
        parent.kill()
        _, err = parent.communicate(timeout=30)
        pytest.fail(f"the parent did not start its child: {line!r}\n{err}")
    return parent, int(line)


def kill_parent_and_check(parent: subprocess.Popen[str], child: int) -> None:
    try:
        assert _alive(child), "the child should be running while its parent lives"
        time.sleep(0.5)
        assert _alive(child), "the child must not stop while its parent lives"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert _wait_gone(child), f"child {child} outlived its parent killed by SIGKILL"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
