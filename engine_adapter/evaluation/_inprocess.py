"""Evaluators that run inside the engine process: the local engine's ``--evaluator-mode
inprocess`` and ``python``, the servers' ``EVALD_INPROCESS``, and the lab's comparisons.

- :class:`InProcessWasmEvaluator`: the daemon's own WASM host (same ABI validation, limits and
  fast call path) on a small thread pool — the cost of evald without the process hop.
- :class:`ReferenceEvaluator`: the Python reference implementations
  (``evaluators_wasm.reference``, the written semantics in executable form) — the "just call a
  Python function" baseline. They ship in the wheel with the guests (docs/design.md §8, "The
  wheel"): ``--evaluator-mode python`` is a documented mode of the local engine.

Both honour the :class:`~engine_adapter.SpanEvaluator` contract: ``submit`` returns at once, the
future never raises, and it completes by the deadline (``deadline_exceeded``) even when the work
is still running (a Python reference call cannot be interrupted; its late answer is dropped).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import heapq
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine_adapter.spans import EvalResult
from evald.contract import ErrorCode

__all__ = ["InProcessWasmEvaluator", "ReferenceEvaluator"]


class _PoolEvaluator:
    """A thread pool plus a deadline thread; subclasses say how to evaluate one span."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, threads), thread_name_prefix=name
        )
        self._lock = threading.Condition()
        self._deadlines: list[tuple[float, int, concurrent.futures.Future[EvalResult]]] = []
        self._seq = 0
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name=f"{name}-deadlines", daemon=True)
        self._reaper.start()

    def _evaluate(self, evaluator: str, content: bytes, deadline_ms: int) -> EvalResult:
        raise NotImplementedError

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        """Runs the evaluation on the pool; returns at once."""
        outer: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        if self._closed:
            outer.set_result(EvalResult(None, ErrorCode.UNAVAILABLE, "the evaluator is closed"))
            return outer
        deadline_ms = max(1, int(deadline_ms))
        data = content.encode("utf-8", errors="surrogateescape")

        def work() -> None:
            if outer.done():
                return  # its deadline passed while it queued
            try:
                result = self._evaluate(evaluator, data, deadline_ms)
            except Exception as exc:
                result = EvalResult(None, ErrorCode.INTERNAL, f"evaluation failed: {exc}")
            _settle(outer, result)

        with self._lock:
            self._seq += 1
            heapq.heappush(
                self._deadlines, (time.monotonic() + deadline_ms / 1000.0, self._seq, outer)
            )
            self._lock.notify()
        self._pool.submit(work)
        return outer

    def flush(self) -> None:
        """Nothing to batch: work starts on submit."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reaper.join(timeout=5)
        self._close_backend()

    def _close_backend(self) -> None:
        pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _reap(self) -> None:
        while True:
            due: list[concurrent.futures.Future[EvalResult]] = []
            with self._lock:
                if self._closed:
                    pending = [entry[2] for entry in self._deadlines]
                    self._deadlines.clear()
                    break
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][0] <= now or self._deadlines[0][2].done()
                ):
                    entry = heapq.heappop(self._deadlines)
                    if not entry[2].done():
                        due.append(entry[2])
                if not due:
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._lock.wait(wait)
                    continue
            for future in due:
                _settle(
                    future,
                    EvalResult(None, ErrorCode.DEADLINE_EXCEEDED, "no result within the deadline"),
                )
        for future in pending:
            _settle(future, EvalResult(None, ErrorCode.UNAVAILABLE, "the evaluator was closed"))


def _settle(future: concurrent.futures.Future[EvalResult], result: EvalResult) -> None:
    try:
        future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # the deadline (or close) answered first


class InProcessWasmEvaluator(_PoolEvaluator):
    """The evald WASM host inside the engine process.

    Parameters:
        modules: ``.wasm`` files to load (default: ``evaluators_wasm/wasm/*.wasm``); each is
            reachable by its manifest name and by its tag.
        limits: per-evaluation limits (``evald.Limits``); a span's ``deadline_ms`` can only
            shorten the deadline.
        threads: worker threads (a guest call releases the GIL, so two run at once on two cores).
        host_config: ``evald.HostConfig`` (isolation mode, compile cache…).

    Raises:
        evald.EvaldError: a module fails ABI validation.
    """

    def __init__(
        self,
        modules: Iterable[str | Path] | None = None,
        *,
        limits: Any = None,
        threads: int = 2,
        host_config: Any = None,
    ) -> None:
        from evald.host import HostConfig, Limits, WasmHost

        if modules is None:
            import evaluators_wasm

            modules = sorted((Path(evaluators_wasm.__file__).parent / "wasm").glob("*.wasm"))
        self._limits = limits if limits is not None else Limits()
        self._host: Any = WasmHost(host_config if host_config is not None else HostConfig())
        self._modules: dict[str, Any] = {}
        try:
            for path in modules:
                loaded = self._host.load(Path(path).read_bytes(), limits=self._limits)
                self._modules.setdefault(loaded.manifest.tag, loaded)
                self._modules[loaded.manifest.name] = loaded
        except BaseException:
            self._host.close()
            raise
        super().__init__(threads, "evald-inprocess")

    @property
    def names(self) -> list[str]:
        return sorted({m.manifest.name for m in self._modules.values()})

    def _evaluate(self, evaluator: str, content: bytes, deadline_ms: int) -> EvalResult:
        module = self._modules.get(evaluator)
        if module is None:
            message = f"no evaluator named {evaluator!r}"
            return EvalResult(None, ErrorCode.UNKNOWN_EVALUATOR, message)
        limits = self._limits
        if deadline_ms < limits.deadline_ms:
            limits = dataclasses.replace(limits, deadline_ms=deadline_ms)
        outcome = self._host.evaluate(module, content, limits)
        if outcome.error is None:
            return EvalResult(outcome.value, None, "", outcome.fuel_used, outcome.elapsed_us)
        return EvalResult(
            None, outcome.error.value, outcome.message, outcome.fuel_used, outcome.elapsed_us
        )

    def _close_backend(self) -> None:
        # Release every wasmtime object now: freed during interpreter exit, wasmtime-py's
        # finalizers find their C bindings already gone and print tracebacks.
        self._modules.clear()
        self._host.close()
        self._host = None
        gc.collect()


class ReferenceEvaluator(_PoolEvaluator):
    """The Python reference implementations (``evaluators_wasm.reference.NAME.evaluate``).

    Parameters:
        names: evaluators to offer (default: all that import). Looked up by name.
        threads: worker threads (Python code holds the GIL: more threads do not add speed).
    """

    def __init__(self, names: Iterable[str] | None = None, *, threads: int = 1) -> None:
        from evaluators_wasm.reference import reference

        if names is None:
            import evaluators_wasm.reference as package

            folder = Path(package.__file__).parent
            names = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
        self._functions: dict[str, Callable[[bytes], str]] = {n: reference(n) for n in names}
        super().__init__(threads, "evald-reference")

    def _evaluate(self, evaluator: str, content: bytes, deadline_ms: int) -> EvalResult:
        from evaluators_wasm.reference import GuestError

        function = self._functions.get(evaluator)
        if function is None:
            message = f"no evaluator named {evaluator!r}"
            return EvalResult(None, ErrorCode.UNKNOWN_EVALUATOR, message)
        started = time.perf_counter_ns()
        try:
            value = function(content)
        except GuestError as exc:
            elapsed = (time.perf_counter_ns() - started) // 1000
            return EvalResult(None, exc.code, exc.message, 0, elapsed)
        return EvalResult(value, None, "", 0, (time.perf_counter_ns() - started) // 1000)
