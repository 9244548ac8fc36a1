"""The local engine's one error type, apart so that every module of the engine can raise it."""

from __future__ import annotations

__all__ = ["EngineError"]


class EngineError(ValueError):
    """A request the engine cannot run: a prefix the grammar refuses, a prompt longer than the
    context window, a mode that needs an evaluator when none was given."""
