"""Where ``grammar-eval`` spans go: the evald daemon, the WASM host inside this process, or the
Python reference implementations, with the manifests of what each can evaluate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_adapter.local._errors import EngineError

if TYPE_CHECKING:
    from engine_adapter.spans import EvaluatorSpec, SpanEvaluator

__all__ = ["EVALUATOR_MODES", "EvaluatorSetup", "open_evaluator"]

#: Where ``grammar-eval`` spans go: the evald daemon, the WASM host inside this process, or the
#: Python reference implementations.
EVALUATOR_MODES = ("evald", "inprocess", "python")


@dataclass
class EvaluatorSetup:
    """An evaluator plus the manifests of what it can evaluate (the grammar's evaluators)."""

    kind: str
    evaluator: SpanEvaluator
    evaluators: list[EvaluatorSpec]
    warning: str | None = None
    """Set when something is degraded but usable (evald not reachable at start-up)."""

    def close(self) -> None:
        """Closes the evaluator (the engine using it never does)."""
        close = getattr(self.evaluator, "close", None)
        if close is not None:
            close()


def open_evaluator(
    kind: str,
    *,
    target: str | None = None,
    token: str | None = None,
    names: Sequence[str] | None = None,
    connect_timeout_s: float = 5.0,
) -> EvaluatorSetup:
    """Opens the evaluator behind ``grammar-eval`` and lists the evaluators it offers.

    Parameters:
        kind: ``evald`` (the daemon, over one bidirectional stream), ``inprocess`` (the same
            WASM host inside this process) or ``python`` (the reference implementations).
        target, token: the daemon's address and bearer token (``evald`` only).
        names: restrict the grammar to these evaluators (default: every one offered).
        connect_timeout_s: how long to wait for the daemon at start-up.

    When the daemon cannot be reached, the standard manifests stand in for ``ListEvaluators``
    and :attr:`EvaluatorSetup.warning` says so: generation still runs, and every span gets
    ``<result_error>unavailable</result_error>`` until the daemon is back.

    Raises:
        EngineError: unknown ``kind``, a requested name that is not offered, or a token that
            is named but empty, blank or malformed (``permission_denied``; never read as none).
    """
    from engine_adapter.evaluation import InProcessWasmEvaluator, ReferenceEvaluator
    from engine_adapter.spans import standard_evaluators

    warning = None
    evaluator: Any
    if kind == "evald":
        evaluator, specs, warning = _open_daemon(target, token, connect_timeout_s)
    elif kind == "inprocess":
        from evald.contract import EvaldError

        try:
            evaluator = InProcessWasmEvaluator()
        except (EvaldError, OSError) as exc:
            raise EngineError(f"cannot load the standard WASM evaluators: {exc}") from exc
        specs = standard_evaluators(evaluator.names)
    elif kind == "python":
        specs = [spec for spec in standard_evaluators() if _has_reference(spec.name)]
        evaluator = ReferenceEvaluator([spec.name for spec in specs])
    else:
        raise EngineError(
            f"unknown evaluator mode {kind!r}; choose one of {', '.join(EVALUATOR_MODES)}"
        )
    if names is not None:
        specs = _named(kind, evaluator, specs, names)
    return EvaluatorSetup(kind, evaluator, specs, warning)


def _open_daemon(
    target: str | None, token: str | None, connect_timeout_s: float
) -> tuple[Any, list[EvaluatorSpec], str | None]:
    """The daemon's client, its evaluators and a warning: when the daemon does not answer,
    the standard manifests stand in and generation still runs (spans answer ``unavailable``)."""
    from engine_adapter.evaluation import EvaluatorClient, list_evaluators
    from engine_adapter.spans import standard_evaluators
    from evald.client import CallError

    try:
        evaluator = EvaluatorClient(target, token)
    except CallError as exc:  # a named token that is empty, blank or malformed
        code = exc.code.value if exc.code else "unreachable"
        raise EngineError(f"{code}: {exc.message}") from None
    try:
        specs = list_evaluators(evaluator.target, token, timeout_s=connect_timeout_s)
        evaluator.wait_connected(connect_timeout_s)
    except Exception as exc:  # unreachable or refused: degrade, never crash
        warning = (
            f"evald at {evaluator.target} did not answer ({exc}); spans will get "
            "<result_error>unavailable</result_error> until it does. Start it with "
            "`evald serve`."
        )
        return evaluator, standard_evaluators(), warning
    return evaluator, specs, None


def _named(
    kind: str, evaluator: Any, specs: list[EvaluatorSpec], names: Sequence[str]
) -> list[EvaluatorSpec]:
    """``specs`` restricted to ``names``, in that order; a name not offered closes the
    evaluator (it would otherwise hold its stream or host open) and is refused."""
    by_name = {spec.name: spec for spec in specs}
    missing = [name for name in names if name not in by_name]
    if missing:
        close = getattr(evaluator, "close", None)
        if close is not None:
            close()
        raise EngineError(
            f"evaluator(s) {', '.join(missing)} not offered by {kind}; offered: "
            f"{', '.join(sorted(by_name))}"
        )
    return [by_name[name] for name in names]


def _has_reference(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"evaluators_wasm.reference.{name}") is not None
