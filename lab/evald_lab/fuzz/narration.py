"""What a run tells its console: a line per phase, and the main loop's progress bar.

Quiet without a console (tests, ``run_fuzz`` called from code); the bar only with ``progress``
on (``--no-progress`` turns it off, for logs). ``rich`` is imported only when a bar is drawn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Narrator", "ProgressSink"]

#: Reports progress: how much is completed (in the bar's unit) and a one-line description.
ProgressSink = Callable[[float, str], None]


class Narrator:
    """Prints to ``console`` (a ``rich`` console, or None for silence)."""

    def __init__(self, console: Any, *, progress: bool) -> None:
        self.console = console
        self.show_progress = progress

    def say(self, text: str) -> None:
        """The phase the run is entering."""
        if self.console is not None:
            self.console.print(f"[bold]evald fuzz[/bold]: {text}")

    def warn(self, text: str) -> None:
        """Something the run survived but its reader should know (steps that raised)."""
        if self.console is not None:
            self.console.print(f"[yellow]{text}")

    @contextlib.contextmanager
    def progress(self, total: float) -> Iterator[ProgressSink | None]:
        """A progress bar up to ``total`` while the block runs (None when there is none)."""
        if not self.show_progress or self.console is None:
            yield None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        ) as bar:
            task = bar.add_task("fuzz", total=total)

            def update(completed: float, description: str) -> None:
                bar.update(task, completed=completed, description=description)

            yield update
