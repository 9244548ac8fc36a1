"""The measurement jobs of ``evald bench`` and ``engine-adapter bench``, each in its own module.

A job's module holds its flags (``add_arguments(parser)``), its run (``main(args) -> int``) and
its docstring (the job's ``--help``). Both command lines import this lab at every start-up (entry
points), and some jobs import XGrammar, torch or numpy at the top: so a job's module is imported
only when that job is chosen, by :class:`JobParser`, the parser class of the jobs' subparsers.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["JobParser", "add_job", "run_job"]


class JobParser(argparse.ArgumentParser):
    """A job's parser; for a job with a module, the flags are added when it first parses."""

    def __init__(self, *args: Any, job_module: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.job_module = job_module
        self._loaded = not job_module

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if not self._loaded:
            self._loaded = True
            module = importlib.import_module(self.job_module)
            self.description = module.__doc__
            self.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(self)
            self.set_defaults(_job_module=self.job_module)
        return super().parse_known_args(args, namespace)


def add_job(jobs: Any, name: str, module: str, help: str) -> None:
    """Adds job ``name`` (its flags and run in ``module``) to a ``JobParser`` subparsers action."""
    jobs.add_parser(name, help=help, job_module=module)


def run_job(args: argparse.Namespace) -> int | None:
    """Runs the chosen job if it has a module of its own; None when it has not."""
    name = getattr(args, "_job_module", None)
    if name is None:
        return None
    module: ModuleType = importlib.import_module(name)
    status: int = module.main(args)
    return status
