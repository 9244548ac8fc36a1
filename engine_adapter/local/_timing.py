"""The clock of one generation: the decode loop passes named points, this turns them into the
timings of :class:`~engine_adapter.local.GenerationResult`.

Each timed phase is a :class:`Stopwatch` used as ``with clock.step.mask: …``, so a timing covers
exactly the work inside its block and never what happens between blocks (detokenizing, the
streaming callback, bookkeeping). What the phases mean:

- ``grammar_compile``: building the span grammar (unless one was given) and compiling it, or
  finding it in the engine's cache; 0 in no-grammar mode.
- ``prefill``: dropping the KV cache positions that cannot be reused and forwarding the rest of
  the prompt and prefix (the first :class:`StepTiming`, kind ``prefill``).
- per step: ``mask`` (fill and apply the grammar's bitmask), ``sample``, ``accept`` (matcher,
  end-of-turn check, injector), ``wait`` (blocked on evaluation results, summed over the waits of
  the step) and ``forward`` (the one forward of the sampled token plus any forced tokens).
- ``decode_us``: from the end of the prefill to the finished answer; ``total_us``: from the
  clock's creation (after the request's arguments are checked) to the finished answer.

Durations are whole microseconds, truncated as each block ends.
"""

from __future__ import annotations

import time

from engine_adapter.local._result import GenerationResult, StepTiming

__all__ = ["GenerationClock", "StepClock", "Stopwatch"]


class Stopwatch:
    """Adds the time spent inside each ``with`` block to :attr:`us`."""

    __slots__ = ("_start_ns", "us")

    def __init__(self) -> None:
        self.us = 0
        self._start_ns = 0

    def __enter__(self) -> None:
        self._start_ns = time.perf_counter_ns()

    def __exit__(self, *exc_info: object) -> None:
        self.us += (time.perf_counter_ns() - self._start_ns) // 1000


class StepClock:
    """The phases of one decode step, zeroed by :meth:`start` at the top of each step."""

    __slots__ = ("accept", "forward", "mask", "sample", "wait")

    def __init__(self) -> None:
        self.mask = Stopwatch()
        self.sample = Stopwatch()
        self.accept = Stopwatch()
        self.wait = Stopwatch()
        self.forward = Stopwatch()

    def start(self) -> None:
        """A new step begins: every phase back to 0."""
        self.mask.us = self.sample.us = self.accept.us = self.wait.us = self.forward.us = 0

    def timing(self, kind: str, n_forwarded: int) -> StepTiming:
        """The step as recorded so far."""
        return StepTiming(
            kind,
            n_forwarded,
            self.forward.us,
            self.mask.us,
            self.sample.us,
            self.accept.us,
            self.wait.us,
        )


class GenerationClock:
    """Times one generation; created when the request starts (its ``total_us`` begins here)."""

    def __init__(self) -> None:
        self._started_ns = time.perf_counter_ns()
        self._decode_started_ns = self._started_ns
        self.grammar_compile = Stopwatch()
        self.prefill = Stopwatch()
        self.step = StepClock()
        self.steps: list[StepTiming] = []

    def prefilled(self, n_forwarded: int) -> None:
        """The prefill forward is done: records it as the first step; decoding starts next."""
        self.steps.append(StepTiming("prefill", n_forwarded, self.prefill.us))

    def decode_started(self) -> None:
        """Decoding starts now (``decode_us`` counts from here)."""
        self._decode_started_ns = time.perf_counter_ns()

    def step_done(self, kind: str, n_forwarded: int) -> StepTiming:
        """The current step's forward is done: records the step and returns its timing."""
        timing = self.step.timing(kind, n_forwarded)
        self.steps.append(timing)
        return timing

    def finish(self, result: GenerationResult) -> None:
        """The answer is complete: writes every timing into ``result``."""
        now_ns = time.perf_counter_ns()
        result.steps = self.steps
        result.grammar_compile_us = self.grammar_compile.us
        result.prefill_us = self.prefill.us
        result.decode_us = (now_ns - self._decode_started_ns) // 1000
        result.total_us = (now_ns - self._started_ns) // 1000
