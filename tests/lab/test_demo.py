"""The `make run` demo section runs against a real daemon and shows real values."""

from __future__ import annotations

import io

from daemon_harness import Daemon
from rich.console import Console

from evald_lab.demo import EXAMPLES, show_evaluations


def test_demo_shows_evaluations_through_evald_call(daemon: Daemon) -> None:
    buffer = io.StringIO()
    show_evaluations(daemon.target, Console(file=buffer, width=200))
    text = buffer.getvalue()
    served = {info.name for info in daemon.client().list_evaluators()}
    assert "evaluators served:" in text
    if "calc" in served:
        assert "482" in text
        assert "error: division_by_zero" in text
    for name in {name for name, _ in EXAMPLES} - served:
        assert name in text.split("skipped (not built):")[1]
