"""Noisy neighbour: does an attacker that burns its whole budget on every call slow a victim down?

In one run, against one daemon: the victim's latency (p50/p99 of sequential unary calls) alone,
then while ``attackers`` threads of the attacker tenant call an infinite-loop module back to back,
so every attacker call runs until its fuel or deadline stops it. The report gives both and their
ratio. Every call of both tenants is checked like any other (typed outcome, limits).

:func:`measure_registration_neighbour` does the same with the attacker registering modules of
about 1 MiB of code back to back (each upload new bytes, so each is validated and compiled).
"""

from __future__ import annotations

import statistics
import threading
import time

from evald.client import CallError
from evald.contract import append_custom_section, pb
from evald.testing import guest, manifest_bytes
from evald_lab.fuzz.checks import Violation, outcome_label
from evald_lab.fuzz.context import FuzzContext

__all__ = ["heavy_module", "measure_noisy_neighbour", "measure_registration_neighbour"]

_KLASS = "noisy_neighbour"
_VICTIM_INPUT = b"17 * 23 + 91"
_VICTIM_VALUE = "482"


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "max_ms": 0.0, "samples": 0}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "p50_ms": at(0.50),
        "p99_ms": at(0.99),
        "mean_ms": round(statistics.fmean(ordered), 3),
        "max_ms": round(ordered[-1], 3),
        "samples": len(ordered),
    }


def _victim_latencies(ctx: FuzzContext, samples: int) -> list[float]:
    client = ctx.client(ctx.victim, timeout_s=30.0)
    latencies: list[float] = []
    for index in range(samples):
        request = pb.EvaluateRequest(evaluator="calc", input=_VICTIM_INPUT, id=f"v{index}")
        started = time.perf_counter()
        try:
            response = client._invoke(client._stub.Evaluate, request)
        except CallError as error:
            ctx.recorder.outcome(
                _KLASS, f"call:{error.code.value if error.code else 'unreachable'}"
            )
            ctx.recorder.add([Violation("unexpected", _KLASS, f"a victim call failed: {error}")])
            continue
        elapsed_ms = (time.perf_counter() - started) * 1000
        latencies.append(elapsed_ms)
        ctx.recorder.outcome(
            _KLASS, outcome_label(response), family="victim", eval_us=response.eval_time_us
        )
        ctx.recorder.call(_KLASS, elapsed_ms)
        ctx.settle(
            _KLASS,
            ctx.victim,
            ctx.checker.evaluation(_KLASS, ctx.victim, request, response),
            [(request, response)],
        )

        def again(request: pb.EvaluateRequest = request) -> float:
            began = time.perf_counter()
            client._invoke(client._stub.Evaluate, request)
            return time.perf_counter() - began

        ctx.latency(
            _KLASS,
            elapsed_ms / 1000,
            ctx.bounds[ctx.victim].deadline_ms / 1000,
            "a victim call",
            again,
        )
        if response.value != _VICTIM_VALUE:
            ctx.recorder.add([Violation("unexpected", _KLASS, f"victim got {response.value!r}")])
    return latencies


def measure_noisy_neighbour(ctx: FuzzContext, *, samples: int, attackers: int) -> dict[str, object]:
    """Victim p50/p99 alone and under attack, in this run; returns the report section."""
    loop = ctx.secrets.attacker_loop
    _victim_latencies(ctx, min(50, samples))  # warm the victim's instances and the channel
    alone = _victim_latencies(ctx, samples)

    stop = threading.Event()
    attacker_calls = 0
    attacker_outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def burn() -> None:
        nonlocal attacker_calls
        client = ctx.client(ctx.attacker, timeout_s=30.0)
        index = 0
        while not stop.is_set():
            request = pb.EvaluateRequest(evaluator=loop, input=b"x", id=f"a{index}")
            index += 1
            try:
                response = client._invoke(client._stub.Evaluate, request)
            except CallError as error:
                ctx.recorder.add(
                    [Violation("unexpected", _KLASS, f"an attacker call failed: {error}")]
                )
                continue
            label = outcome_label(response)
            with lock:
                attacker_calls += 1
                attacker_outcomes[label] = attacker_outcomes.get(label, 0) + 1
            ctx.recorder.outcome(
                _KLASS, label, family="attacker_burn", eval_us=response.eval_time_us
            )
            ctx.settle(
                _KLASS,
                ctx.attacker,
                ctx.checker.evaluation(_KLASS, ctx.attacker, request, response),
                [(request, response)],
            )
            if label not in ("deadline_exceeded", "fuel_exhausted"):
                ctx.recorder.add(
                    [Violation("unexpected", _KLASS, f"an infinite loop ended with {label}")]
                )

    burners = [
        threading.Thread(target=burn, name=f"fuzz-burn-{i}", daemon=True) for i in range(attackers)
    ]
    for thread in burners:
        thread.start()
    time.sleep(0.3)  # every burner has a call running
    try:
        loaded = _victim_latencies(ctx, samples)
    finally:
        stop.set()
        for thread in burners:
            thread.join(timeout=60)
    alone_stats = _percentiles(alone)
    loaded_stats = _percentiles(loaded)

    def ratio(key: str) -> float:
        base = alone_stats[key]
        return round(loaded_stats[key] / base, 2) if base else 0.0

    return {
        "victim_call": f"calc {_VICTIM_INPUT.decode()!r} (unary Evaluate, sequential)",
        "attacker_call": "an infinite loop in eval (unary Evaluate, back to back)",
        "attackers": attackers,
        "daemon_threads": ctx.threads,
        "alone": alone_stats,
        "under_attack": loaded_stats,
        "ratio_p50": ratio("p50_ms"),
        "ratio_p99": ratio("p99_ms"),
        "attacker_calls": attacker_calls,
        "attacker_outcomes": attacker_outcomes,
    }


def heavy_module(name: str, *, functions: int = 4000, body_ops: int = 60) -> bytes:
    """An evaluator with about ``functions * body_ops * 4`` bytes of code (1 MiB by default):
    expensive to validate and compile, valid and harmless to run."""
    body = "(local.get 0) " + " ".join(f"(i32.const {k}) (i32.xor)" for k in range(body_ops))
    extra = "".join(f"(func (param i32) (result i32) {body})" for _ in range(functions))
    manifest = manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    return guest("echo", manifest=manifest, extra=extra)


def measure_registration_neighbour(ctx: FuzzContext, *, samples: int) -> dict[str, object]:
    """Victim p50/p99 alone and while the attacker registers heavy modules back to back."""
    name = "noisy_register"
    base = heavy_module(name)
    _victim_latencies(ctx, min(50, samples))
    alone = _victim_latencies(ctx, samples)
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    seconds: list[float] = []

    def register() -> None:
        client = ctx.client(ctx.attacker, timeout_s=120.0)
        index = 0
        while not stop.is_set():
            # new bytes every time: nothing to shortcut, every upload is compiled
            wasm = append_custom_section(base, "pad", index.to_bytes(8, "little"))
            index += 1
            began = time.perf_counter()
            try:
                client.register(wasm, replace=True)
                label = "registered"
            except CallError as error:
                label = f"call:{error.code.value if error.code else 'unreachable'}"
                if error.code is None or error.code.value not in ("unavailable",):
                    ctx.recorder.add(
                        [Violation("unexpected", _KLASS, f"a heavy registration failed: {error}")]
                    )
            with lock:
                outcomes[label] = outcomes.get(label, 0) + 1
                seconds.append(time.perf_counter() - began)
            ctx.recorder.outcome(_KLASS, label, family="attacker_register")

    registrar = threading.Thread(target=register, name="fuzz-register", daemon=True)
    registrar.start()
    time.sleep(0.5)  # the first compilation is under way
    try:
        # At least ``samples`` calls, and long enough to span several registrations (each
        # takes seconds), at most a minute.
        loaded = _victim_latencies(ctx, samples)
        give_up = time.monotonic() + 60.0
        while time.monotonic() < give_up:
            with lock:
                done = len(seconds)
            if done >= 3:
                break
            loaded += _victim_latencies(ctx, 200)
    finally:
        stop.set()
        registrar.join(timeout=120)
    with_registrations = _percentiles(loaded)
    alone_stats = _percentiles(alone)

    def ratio(key: str) -> float:
        base_value = alone_stats[key]
        return round(with_registrations[key] / base_value, 2) if base_value else 0.0

    return {
        "victim_call": f"calc {_VICTIM_INPUT.decode()!r} (unary Evaluate, sequential)",
        "attacker_call": f"RegisterEvaluator of {len(base):,}-byte modules, back to back",
        "alone": alone_stats,
        "under_registration": with_registrations,
        "ratio_p50": ratio("p50_ms"),
        "ratio_p99": ratio("p99_ms"),
        "registrations": outcomes,
        "median_registration_s": round(statistics.median(seconds), 3) if seconds else 0.0,
    }
