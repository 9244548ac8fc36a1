"""What an evaluation ends with, and how each way of failing becomes an error code.

:meth:`evald.host.WasmHost.evaluate` always returns an :class:`EvalOutcome`: a guest's error,
a trap or a limit hit is a value with a typed :class:`~evald.contract.ErrorCode`, never an
exception, so one bad input cannot take a worker thread (or the daemon) down. Inside the host a
failure travels as a :class:`Failure` exception from wherever it is found to ``evaluate``, which
turns it into the outcome.

This module says what a trap means — in a call (:func:`call_trap_failure`) or in a start
function (:func:`start_trap_failure`) — by its trap code, never by message text; what the guest
itself returned, a value or its own error, is read by :mod:`evald.host._guest_output`. Messages
name the limit that was hit and its setting, so whoever reads one knows what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import wasmtime

from evald.contract import ErrorCode
from evald.host._limits import Limits

__all__ = [
    "EvalOutcome",
    "Failure",
    "call_trap_failure",
    "first_line",
    "start_trap_failure",
    "trap_name",
]


class EvalOutcome(NamedTuple):
    """The result of one evaluation (immutable; a named tuple because one is made per call and
    a tuple costs a third of a frozen dataclass).

    Attributes:
        value: the UTF-8 value on success, else None.
        error: the error code on failure, else None.
        message: on failure, a sentence a person can act on ("" on success).
        fuel_used: fuel the guest's ``evald_eval`` consumed (0 when it was not called).
        elapsed_us: wall-clock time of the whole evaluation in the host, microseconds.
    """

    value: str | None
    error: ErrorCode | None
    message: str
    fuel_used: int
    elapsed_us: int

    @property
    def ok(self) -> bool:
        return self.error is None


class Failure(Exception):
    """Internal to the host: ends an evaluation with an error outcome (never escapes
    ``WasmHost.evaluate``; loading turns it into an ``EvaldError``)."""

    def __init__(self, code: ErrorCode, message: str, fuel_used: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fuel_used = fuel_used


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (wasmtime's errors carry a backtrace after it)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def trap_name(trap: wasmtime.Trap) -> str:
    """A trap's code in words (``OUT_OF_FUEL`` -> "out of fuel"), for messages."""
    code = trap.trap_code
    return code.name.lower().replace("_", " ") if code is not None else "unknown trap"


def call_trap_failure(
    trap: wasmtime.Trap,
    *,
    evaluator: str,
    limits: Limits,
    fuel_used: int,
    max_wasm_stack_bytes: int,
    memory_cap: int,
    grow_was_refused: Callable[[], bool],
) -> Failure:
    """What a trap during ``evald_eval`` means: a limit hit, or a fault of the guest.

    Fuel, deadline and stack have trap codes of their own. Running out of memory does not: a
    refused ``memory.grow`` returns -1 to the guest, which then traps in its own way (usually
    ``unreachable``); ``grow_was_refused`` (asked only for those other traps) tells that case
    apart, where the module could be rewritten to record it (:mod:`evald.host._instrument`).
    """
    code = trap.trap_code
    if code is wasmtime.TrapCode.OUT_OF_FUEL:
        return Failure(
            ErrorCode.FUEL_EXHAUSTED,
            f"the evaluation used all {limits.fuel} units of fuel (fuel limit)",
            fuel_used,
        )
    if code is wasmtime.TrapCode.INTERRUPT:
        return Failure(
            ErrorCode.DEADLINE_EXCEEDED,
            f"the evaluation ran past its deadline of {limits.deadline_ms} ms",
            fuel_used,
        )
    if code is wasmtime.TrapCode.STACK_OVERFLOW:
        return Failure(
            ErrorCode.STACK_OVERFLOW,
            "the evaluation exhausted the wasm stack "
            f"({max_wasm_stack_bytes} bytes): recursion too deep",
            fuel_used,
        )
    if grow_was_refused():
        return Failure(
            ErrorCode.MEMORY_LIMIT,
            f"the evaluator needed more than the memory limit of "
            f"{memory_cap} bytes (memory_bytes) and stopped "
            f"({trap_name(trap)})",
            fuel_used,
        )
    return Failure(
        ErrorCode.GUEST_FAULT,
        f"evaluator {evaluator} trapped: {trap_name(trap)}",
        fuel_used,
    )


def start_trap_failure(trap: wasmtime.Trap, *, evaluator: str, fuel: int) -> Failure:
    """What a trap in a module's start function means (at instantiation, before any call).

    An evaluator has no business computing at instantiation, and the messages say so: fuel or
    deadline spent there is a defect of the module, not of the input.
    """
    code = trap.trap_code
    if code is wasmtime.TrapCode.OUT_OF_FUEL:
        return Failure(
            ErrorCode.FUEL_EXHAUSTED,
            f"the start function of evaluator {evaluator} used all {fuel} units of "
            "fuel; an evaluator must not compute at instantiation",
            fuel,
        )
    if code is wasmtime.TrapCode.INTERRUPT:
        return Failure(
            ErrorCode.DEADLINE_EXCEEDED,
            f"the start function of evaluator {evaluator} ran past the deadline; "
            "an evaluator must not compute at instantiation",
        )
    if code is wasmtime.TrapCode.STACK_OVERFLOW:
        return Failure(
            ErrorCode.STACK_OVERFLOW,
            f"the start function of evaluator {evaluator} exhausted the wasm stack",
        )
    return Failure(
        ErrorCode.GUEST_FAULT,
        f"the start function of evaluator {evaluator} trapped: {trap_name(trap)}",
    )
