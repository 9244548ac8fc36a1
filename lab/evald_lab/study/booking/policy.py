"""The booking policy as code (the study's ``apply_policy``), and the same policy as a span
evaluator named ``booking_policy`` for the computed arms.

The policy: an age or a total that cannot be determined escalates to a person
(``escalate_human`` / ``insufficient_info``); under 18 or over 70 declines (``under_age`` /
``over_age``); a total above 12,000 declines and one of 10,001 to 12,000 offers an alternative
(both ``over_limit``); everything else books (``book_appointment`` / ``eligible``). The age is
checked before the total, so a 15-year-old asking for £14,000 is declined as under age.

:class:`PolicyEvaluator` answers ``booking_policy`` with :func:`evaluate_policy` in this
process and passes every other evaluator name to the engine's own evaluator: the computed arms
run with it when the engine offers no WASM ``booking_policy`` (the SDK's example policy), and
the study's summary says which one decided.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import dataclass
from typing import Any

from engine_adapter.spans import EvalResult, EvaluatorSpec

__all__ = [
    "ACTIONS",
    "POLICY_NAME",
    "POLICY_SPEC",
    "REASONS",
    "Decision",
    "PolicyEvaluator",
    "WasmPolicy",
    "apply_policy",
    "evaluate_policy",
]

POLICY_NAME = "booking_policy"
ACTIONS = ("book_appointment", "offer_alternative", "decline", "escalate_human")
REASONS = ("eligible", "over_limit", "under_age", "over_age", "insufficient_info")
_MIN_AGE, _MAX_AGE = 18, 70
_BOOK_LIMIT, _OFFER_LIMIT = 10_000, 12_000


@dataclass(frozen=True)
class Decision:
    """What the policy decides: the total it read, the action and the reason."""

    total: int | float | None
    action: str
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "total": self.total}


def apply_policy(
    age: int | float | None, components: list[Any] | tuple[Any, ...] | None
) -> Decision:
    """The policy on the facts: the customer's age (``None``: not given) and the price
    components (empty or ``None``: no prices given)."""
    total = _total(components)
    if age is None or total is None:
        return Decision(total, "escalate_human", "insufficient_info")
    if age < _MIN_AGE:
        return Decision(total, "decline", "under_age")
    if age > _MAX_AGE:
        return Decision(total, "decline", "over_age")
    if total > _OFFER_LIMIT:
        return Decision(total, "decline", "over_limit")
    if total > _BOOK_LIMIT:
        return Decision(total, "offer_alternative", "over_limit")
    return Decision(total, "book_appointment", "eligible")


def _total(components: list[Any] | tuple[Any, ...] | None) -> int | float | None:
    """The sum, an integer when it is whole (so ``7700``, never ``7700.0``, is forced)."""
    if not components:
        return None
    total = round(sum(float(c) for c in components), 2)
    return int(total) if total.is_integer() else total


def evaluate_policy(content: str) -> str:
    """The evaluator's contract: ``{"age": 34, "components": [6500, 1200]}`` in, the decision's
    compact JSON out (``{"action":"book_appointment","reason":"eligible","total":7700}``).

    Raises:
        ValueError: the input is not such an object (the evaluator answers ``syntax``).
    """
    try:
        facts = json.loads(content)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the input is not JSON: {exc}") from None
    if not isinstance(facts, dict):
        raise ValueError("the input must be a JSON object with age and components")
    age, components = facts.get("age"), facts.get("components")
    if age is not None and (isinstance(age, bool) or not isinstance(age, int | float)):
        raise ValueError("age must be a number or null")
    if components is not None and (
        not isinstance(components, list)
        or any(isinstance(c, bool) or not isinstance(c, int | float) for c in components)
    ):
        raise ValueError("components must be an array of numbers or null")
    return json.dumps(apply_policy(age, components).as_json(), separators=(",", ":"))


#: The policy's manifest as the grammar reads it: one JSON object in, one JSON object out.
POLICY_SPEC = EvaluatorSpec(
    name=POLICY_NAME,
    tag=POLICY_NAME,
    input_grammar='root ::= "{" [^<]* "}"',
    result_regex=r"\{[^<]*\}",
    description="The booking policy: the customer's age and price components in, the total, "
    "action and reason out.",
    input_schema={
        "type": "object",
        "properties": {
            "age": {"type": ["integer", "null"]},
            "components": {"type": ["array", "null"], "items": {"type": "number"}},
        },
        "required": ["age", "components"],
    },
    result_schema={
        "type": "object",
        "properties": {
            "total": {"type": ["number", "null"]},
            "action": {"enum": list(ACTIONS)},
            "reason": {"enum": list(REASONS)},
        },
        "required": ["total", "action", "reason"],
    },
)


class PolicyEvaluator:
    """A :class:`~engine_adapter.SpanEvaluator` that evaluates ``booking_policy`` with
    :func:`evaluate_policy` and passes every other name to ``inner`` (the engine's evaluator).

    The policy takes microseconds, so its future is complete when :meth:`submit` returns.
    Closing it leaves ``inner`` open: whoever opened it closes it.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        if evaluator != POLICY_NAME:
            future: concurrent.futures.Future[EvalResult] = self.inner.submit(
                evaluator, content, deadline_ms
            )
            return future
        from evald.contract import ErrorCode

        started = time.perf_counter_ns()
        done: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        try:
            value = evaluate_policy(content)
        except ValueError as exc:
            elapsed = (time.perf_counter_ns() - started) // 1000
            done.set_result(EvalResult(None, ErrorCode.SYNTAX.value, str(exc), 0, elapsed))
            return done
        elapsed = (time.perf_counter_ns() - started) // 1000
        done.set_result(EvalResult(value, None, "", 0, elapsed))
        return done

    def flush(self) -> None:
        flush = getattr(self.inner, "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        """Nothing of its own to release (``inner`` is its opener's to close)."""


class WasmPolicy:
    """A :class:`~engine_adapter.SpanEvaluator` that evaluates ``booking_policy`` with the SDK's
    example policy (``evaluators_wasm/examples/booking_policy``: Zig and the guest JSON library,
    built reproducibly, run by the in-process WASM host under evald's default limits) and passes
    every other name to ``inner``. :attr:`spec` is its manifest as the grammar reads it (its
    ``input_schema`` and ``result_schema`` check the computed arms' schema)."""

    def __init__(self, inner: Any) -> None:
        from engine_adapter import InProcessWasmEvaluator
        from evaluators_wasm import EXAMPLES_DIR, example_path

        folder = EXAMPLES_DIR / POLICY_NAME
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["input_grammar"] = (folder / "grammar.ebnf").read_text()
        self.spec = EvaluatorSpec.from_manifest(manifest)
        self.inner = inner
        self._wasm = InProcessWasmEvaluator([example_path(POLICY_NAME)], threads=1)

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        target = self._wasm if evaluator == POLICY_NAME else self.inner
        future: concurrent.futures.Future[EvalResult] = target.submit(
            evaluator, content, deadline_ms
        )
        return future

    def flush(self) -> None:
        flush = getattr(self.inner, "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        """Releases the policy's WASM host (``inner`` is its opener's to close)."""
        self._wasm.close()
