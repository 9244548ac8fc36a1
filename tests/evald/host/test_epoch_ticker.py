"""The epoch ticker does not wait for the GIL: a thread that holds it cannot stretch a deadline.

The hog is a catastrophic regular expression: CPython's ``re`` holds the GIL for the whole
match (about a second here), as any long C call that does not release it would. A guest that
loops under a 20 ms deadline starts just before the hog takes the GIL. How long the guest really
ran is the CPU time of the thread that ran it (a thread waiting for the GIL uses none, so this
does not depend on when the thread gets the GIL back to look at the clock): with the native
ticker the guest stops at its deadline; with the Python ticker (the fallback) it runs for as
long as the hog holds the GIL (measured 0.15-1 s of CPU, depending on the machine's load).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from daemon_harness import module

from evald.host import EvalOutcome, HostConfig, Limits, LoadedModule, WasmHost, _engine

#: Not metered: the deadline is what stops the guest.
_LIMITS = Limits(fuel=0, deadline_ms=20)
_HOG_PATTERN = re.compile(r"(a|aa)*c")
_HOG_INPUT = "a" * 33  # about a second of matching, GIL held throughout


def _host(native: bool, monkeypatch: pytest.MonkeyPatch) -> WasmHost:
    original = _engine.EpochTicker.__init__

    def init(self: _engine.EpochTicker, engine: object, tick_ms: float, **_: object) -> None:
        original(self, engine, tick_ms, native=native)  # type: ignore[arg-type]

    monkeypatch.setattr(_engine.EpochTicker, "__init__", init)
    return WasmHost(HostConfig())


def _run_with_hog(host: WasmHost, loaded: LoadedModule) -> tuple[EvalOutcome, float, bool]:
    """One evaluation with the hog taking the GIL once the guest runs: its outcome, the CPU
    seconds the guest's thread used, and whether the hog really started while the guest ran."""
    go = threading.Event()
    marks: dict[str, float] = {}

    def hog() -> None:
        go.wait()
        marks["hog"] = time.perf_counter()
        _HOG_PATTERN.fullmatch(_HOG_INPUT)

    thread = threading.Thread(target=hog)
    thread.start()
    go.set()
    marks["call"] = time.perf_counter()
    cpu = time.thread_time()
    outcome = host.evaluate(loaded, b"", _LIMITS)
    cpu = time.thread_time() - cpu
    thread.join()
    return outcome, cpu, marks["call"] <= marks.get("hog", 0.0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_gil_hog_does_not_stretch_a_deadline(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native and _engine._NATIVE is None:
        pytest.fail(f"the native ticker is not built: {_engine._NATIVE_MISSING}")
    host = _host(native, monkeypatch)
    try:
        assert host._ticker is not None and host._ticker.native is native
        loaded = host.load(module("loop", "spin"))
        for _attempt in range(5):
            hogged, cpu_s, overlapped = _run_with_hog(host, loaded)
            if overlapped:
                break
        else:
            pytest.skip("the hog never started while the guest ran")
        assert hogged.error is not None and hogged.error.value == "deadline_exceeded"
        if native:
            # stopped at its 20 ms deadline (CPU time cannot exceed the guest's wall time)
            assert cpu_s < 0.060, cpu_s
        # The fallback still stops the guest, late: it ran for as long as the hog held the GIL
        # (about a second of wall time here; its CPU share depends on the machine's load, so
        # it is reported, not asserted).
        print(f"{'native' if native else 'python'} ticker: guest CPU {cpu_s * 1000:.1f} ms")
    finally:
        host.close()


def test_the_native_ticker_keeps_the_epoch_on_the_wall_clock() -> None:
    if _engine._NATIVE is None:
        pytest.fail(f"the native ticker is not built: {_engine._NATIVE_MISSING}")
    host = WasmHost(HostConfig(epoch_tick_ms=1.0))
    try:
        ticker = host._ticker
        assert ticker is not None and ticker.native
        time.sleep(0.2)
        assert ticker.lag_ticks() < 20
        ticker.stop()
        ticker.stop()  # idempotent
    finally:
        host.close()
