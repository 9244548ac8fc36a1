"""The generation clock's arithmetic (no model): which phase gets which time, and how it adds up.

A scripted ``perf_counter_ns`` makes the numbers exact; what the engine times with it on the real
model is checked in ``test_engine.py`` (``test_timings_account_for_the_generation``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine_adapter.local import GenerationResult, StepTiming, _timing
from engine_adapter.local._timing import GenerationClock, StepClock, Stopwatch


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``script(t0, t1, …)``: the clock's next readings, in nanoseconds."""

    def set_readings(*readings_ns: int) -> None:
        readings: Iterator[int] = iter(readings_ns)
        monkeypatch.setattr(_timing.time, "perf_counter_ns", lambda: next(readings))

    return set_readings


def test_a_stopwatch_adds_whole_microseconds_of_each_block(script: Callable[..., None]) -> None:
    watch = Stopwatch()
    script(1_000, 3_999, 10_000, 12_500)
    with watch:
        pass
    with watch:
        pass
    # 2.999 µs and 2.5 µs: each block is truncated as it ends (the sum of ns would give 5).
    assert watch.us == 4


def test_a_stopwatch_counts_a_block_left_by_an_exception(script: Callable[..., None]) -> None:
    watch = Stopwatch()
    script(0, 7_000)
    with pytest.raises(KeyError), watch:
        raise KeyError("inside")
    assert watch.us == 7


def test_a_step_reports_each_phase_in_its_own_field(script: Callable[..., None]) -> None:
    clock = StepClock()
    phases = (clock.mask, clock.sample, clock.accept, clock.wait, clock.forward)
    script(*[t for i in range(len(phases)) for t in (0, (i + 1) * 1_000)])
    for phase in phases:
        with phase:
            pass
    assert clock.timing("inject", 9) == StepTiming(
        "inject", 9, forward_us=5, mask_us=1, sample_us=2, accept_us=3, wait_us=4
    )
    clock.start()
    assert clock.timing("sample", 1) == StepTiming("sample", 1, 0, 0, 0, 0, 0)


def test_waits_add_up_within_a_step_and_start_again_at_the_next(
    script: Callable[..., None],
) -> None:
    clock = StepClock()
    script(0, 2_000, 5_000, 8_000, 20_000, 21_000)
    for _ in range(2):
        with clock.wait:
            pass
    assert clock.timing("inject", 4).wait_us == 5
    clock.start()
    with clock.wait:
        pass
    assert clock.timing("inject", 4).wait_us == 1


def test_the_generation_clock_fills_the_result(script: Callable[..., None]) -> None:
    # created, compile, prefill, decode starts, one step's forward, finished
    script(0, 1_000, 4_000, 5_000, 15_000, 20_000, 100_000, 110_000, 900_000)
    clock = GenerationClock()
    with clock.grammar_compile:
        pass
    with clock.prefill:
        pass
    clock.prefilled(42)
    clock.decode_started()
    clock.step.start()
    with clock.step.forward:
        pass
    assert clock.step_done("sample", 1) == StepTiming("sample", 1, forward_us=10)
    result = GenerationResult("", "no-grammar", "llama", 42, 0, [], 1, 0, "max_new_tokens")
    clock.finish(result)
    assert (result.grammar_compile_us, result.prefill_us) == (3, 10)
    assert result.steps == [StepTiming("prefill", 42, 10), StepTiming("sample", 1, 10)]
    assert (result.decode_us, result.total_us) == (880, 900)
    assert result.n_forwards == 1
