"""The run's tally: what each class sent and got back, and every violation (samples kept).

Thread-safe: the lanes, the monitor and the fault threads record into one :class:`Recorder`
at once. The report (:mod:`evald_lab.fuzz.report_json`) is made from it: per-class inputs,
outcomes and families, call latencies (a bounded reservoir for the percentiles), stalls,
deadline overruns, and the violations by kind.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from evald.contract import ErrorCode
from evald_lab.fuzz.checks import Violation

__all__ = ["ClassStats", "Recorder", "typed_error_count"]

_TYPED_CODES = frozenset(code.value for code in ErrorCode)


def typed_error_count(outcomes: Mapping[str, int]) -> int:
    """How many outcomes are typed errors: an error code, a call refused with one
    (``call:CODE``), or a status gRPC's transport gave before the daemon (``transport:...``).
    Values, registrations, abandoned and parsed inputs are not errors."""
    total = 0
    for label, count in outcomes.items():
        code = label.removeprefix("call:")
        if code in _TYPED_CODES or label.startswith("transport:"):
            total += count
    return total


class _Reservoir:
    """A fixed-size uniform sample of a stream of numbers (for percentiles)."""

    def __init__(self, size: int, seed: int) -> None:
        import random

        self.size = size
        self.values: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            index = self._rng.randrange(self.seen)
            if index < self.size:
                self.values[index] = value

    def percentile(self, q: float) -> float:
        if not self.values:
            return 0.0
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ClassStats:
    """What one input class sent and got back."""

    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    families: Counter[str] = field(default_factory=Counter)
    violations: Counter[str] = field(default_factory=Counter)
    max_eval_us: int = 0
    max_call_ms: float = 0.0
    calls: int = 0
    step_s: float = 0.0
    stalls: int = 0
    max_stall_ms: float = 0.0
    call_ms: _Reservoir = field(default_factory=lambda: _Reservoir(4096, 0))

    @property
    def typed_errors(self) -> int:
        return typed_error_count(self.outcomes)

    def to_json(self) -> dict[str, object]:
        return {
            "inputs": self.inputs,
            "ok": self.outcomes.get("ok", 0),
            "typed_errors": self.typed_errors,
            "outcomes": dict(sorted(self.outcomes.items())),
            "families": dict(sorted(self.families.items())),
            "violations": dict(sorted(self.violations.items())),
            "calls": self.calls,
            "step_s": round(self.step_s, 1),
            "stalls": self.stalls,
            "max_stall_ms": round(self.max_stall_ms, 1),
            "max_eval_us": self.max_eval_us,
            "max_call_ms": round(self.max_call_ms, 3),
            "p50_call_ms": round(self.call_ms.percentile(0.50), 3),
            "p99_call_ms": round(self.call_ms.percentile(0.99), 3),
        }


class Recorder:
    """The thread-safe tally of a run: per-class stats and every violation (samples kept)."""

    def __init__(self, classes: Iterable[str], *, keep: int = 200) -> None:
        self._lock = threading.Lock()
        self.classes: dict[str, ClassStats] = {name: ClassStats() for name in classes}
        self.violations: list[Violation] = []
        self.violation_counts: Counter[str] = Counter()
        self._keep = keep
        # Deadline overruns: evaluations whose eval_time exceeded their effective deadline.
        self.overruns = 0
        self.worst_overrun_us = 0
        self.worst_overrun_deadline_ms = 0
        self.worst_overrun_class = ""

    def overrun(self, klass: str, eval_us: int, deadline_ms: int) -> None:
        """One evaluation's time against its effective deadline (recorded when over it)."""
        over = eval_us - deadline_ms * 1000
        if over <= 0:
            return
        with self._lock:
            self.overruns += 1
            if over > self.worst_overrun_us:
                self.worst_overrun_us = over
                self.worst_overrun_deadline_ms = deadline_ms
                self.worst_overrun_class = klass

    def stats(self, klass: str) -> ClassStats:
        with self._lock:
            return self.classes.setdefault(klass, ClassStats())

    def outcome(self, klass: str, label: str, *, family: str = "", eval_us: int = 0) -> None:
        """One input sent and its outcome (``ok``, an error code, or ``call:CODE``)."""
        with self._lock:
            stats = self.classes.setdefault(klass, ClassStats())
            stats.inputs += 1
            stats.outcomes[label] += 1
            if family:
                stats.families[family] += 1
            if eval_us > stats.max_eval_us:
                stats.max_eval_us = eval_us

    def call(self, klass: str, elapsed_ms: float) -> None:
        """One RPC's wall time."""
        with self._lock:
            stats = self.classes.setdefault(klass, ClassStats())
            stats.calls += 1
            stats.call_ms.add(elapsed_ms)
            stats.max_call_ms = max(stats.max_call_ms, elapsed_ms)

    def stall(self, klass: str, milliseconds: float) -> None:
        """A time over its bound that did not reproduce when the call was repeated: the machine
        (not the daemon) held the thread; counted and reported, not a violation."""
        with self._lock:
            stats = self.classes.setdefault(klass, ClassStats())
            stats.stalls += 1
            stats.max_stall_ms = max(stats.max_stall_ms, milliseconds)

    def step(self, klass: str, seconds: float) -> None:
        """Wall time one main-loop step of ``klass`` took (lanes overlap)."""
        with self._lock:
            self.classes.setdefault(klass, ClassStats()).step_s += seconds

    def add(self, violations: Iterable[Violation]) -> None:
        with self._lock:
            for violation in violations:
                self.violation_counts[violation.kind] += 1
                stats = self.classes.setdefault(violation.klass, ClassStats())
                stats.violations[violation.kind] += 1
                if len(self.violations) < self._keep:
                    self.violations.append(violation)

    @property
    def inputs(self) -> int:
        with self._lock:
            return sum(stats.inputs for stats in self.classes.values())

    @property
    def violation_total(self) -> int:
        with self._lock:
            return sum(self.violation_counts.values())
