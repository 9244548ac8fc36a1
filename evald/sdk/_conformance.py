"""The policy conformance check of ``evald test``: a module whose manifest declares
``input_schema`` or ``result_schema`` reads and returns JSON, and is held to both.

A policy is used through a computed property (docs/computed-fields.md): the engine builds its
input from a document, checks what it returns against the property's schema, and forces it.
So the promise the manifest makes must hold before the module is registered:

* every manifest example's input is JSON and validates against ``input_schema``;
* for every example, the module returns a value (no error), which is JSON, validates against
  ``result_schema``, and equals the example's ``value`` as JSON;
* every value the module returns for a case of the cases file is JSON and validates against
  ``result_schema``;
* malformed JSON (:data:`MALFORMED_INPUTS`: truncated, trailing garbage, bad escapes, lone
  surrogates, invalid UTF-8, nesting a thousand deep) gives a guest error code, never a value,
  a trap or an exhausted limit: the guest's reader must refuse it with ``syntax``.

Each problem names the example's index (``examples[2]``), the case's line or the malformed
input, so a person knows which to fix. The module runs on the daemon's host under the
tenant's limits, as ``run_cases`` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from evald.contract import GUEST_ERROR_CODES, ErrorCode
from evald.host import EvalOutcome, LoadedModule, WasmHost
from evald.sdk._sdk import DaemonSettings, daemon_settings

__all__ = ["MALFORMED_INPUTS", "PolicyReport", "check_policy"]

#: Inputs no JSON reader may accept; each must end in a guest error code.
MALFORMED_INPUTS: Final[tuple[bytes, ...]] = (
    b"",
    b"{",
    b'{"age": 34',
    b'{"age": 34,}',
    b'{"age" 34}',
    b'{"age": 34}}',
    b"[1, 2",
    b"[1, 2,]",
    b"nul",
    b"tru",
    b"01",
    b"1.",
    b"-",
    b"NaN",
    b"{'age': 34}",
    b'"unterminated',
    b'"bad \\x escape"',
    b'"\\ud800"',
    b'{"age": "\x01"}',
    b"\xff\xfe{}",
    b"[" * 1000 + b"]" * 1000,
    b'{"a":' * 1000 + b"1" + b"}" * 1000,
)
_ALLOWED_CODES: Final = {code.value for code in GUEST_ERROR_CODES} | {
    ErrorCode.INPUT_TOO_LARGE.value
}


@dataclass(frozen=True)
class PolicyReport:
    """What the conformance check found: ``checks`` run, and each ``problem`` for people."""

    checks: int
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems


#: A schema's validator (``jsonschema``'s, for the schema's dialect), or None for no schema.
_Check = Any


def _validator(schema: dict[str, Any] | None) -> _Check:
    if schema is None:
        return None
    from jsonschema import validators  # imported only for a module that declares a schema

    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    return cls(schema)


def _schema_problem(validator: _Check, instance: Any, schema_name: str) -> str | None:
    if validator is None:
        return None
    error = next(iter(sorted(validator.iter_errors(instance), key=lambda e: e.path)), None)
    if error is None:
        return None
    where = "/" + "/".join(str(part) for part in error.absolute_path)
    return f"does not validate against {schema_name} at {where}: {error.message}"


def _shown(outcome: EvalOutcome) -> str:
    if outcome.error is None:
        return repr(outcome.value)
    return f"{outcome.error.value}: {outcome.message}".rstrip(": ")


def _example_problems(
    index: int, example: dict[str, str], outcome: EvalOutcome, check: tuple[_Check, _Check]
) -> list[str]:
    """What is wrong with one example (its input, and what the module gave for it)."""
    where = f"examples[{index}]"
    problems = []
    try:
        problem = _schema_problem(check[0], json.loads(example["input"]), "input_schema")
        if problem:
            problems.append(f"{where}: the input {problem}")
    except ValueError as exc:
        problems.append(f"{where}: the input {example['input']!r} is not JSON ({exc})")
    if outcome.error is not None:
        return [*problems, f"{where}: the module answered {_shown(outcome)}, not a value"]
    value = outcome.value or ""
    try:
        got = json.loads(value)
    except ValueError:
        return [*problems, f"{where}: the value {value!r} is not JSON"]
    problem = _schema_problem(check[1], got, "result_schema")
    if problem:
        problems.append(f"{where}: the value {value!r} {problem}")
    try:
        expected = json.loads(example["value"])
    except ValueError:
        expected = example["value"]
    if got != expected:
        said = example["value"]
        problems.append(f"{where}: the module returns {value!r}; the example says {said!r}")
    return problems


def _value_problem(label: str, value: str, result_check: _Check) -> str | None:
    try:
        got = json.loads(value)
    except ValueError:
        return f"{label}: the value {value!r} is not JSON"
    problem = _schema_problem(result_check, got, "result_schema")
    return f"{label}: the value {value!r} {problem}" if problem else None


def _malformed_problem(data: bytes, outcome: EvalOutcome) -> str | None:
    shown = repr(data if len(data) <= 40 else data[:37] + b"...")
    if outcome.error is None:
        return f"malformed input {shown}: the module returned the value {outcome.value!r}"
    if outcome.error.value not in _ALLOWED_CODES:
        return (
            f"malformed input {shown}: the module ended with {_shown(outcome)}, not a guest "
            "error code (a JSON reader must refuse it with syntax)"
        )
    return None


def check_policy(
    wasm: bytes,
    settings: DaemonSettings | None = None,
    case_inputs: Sequence[tuple[str, str]] = (),
) -> PolicyReport | None:
    """Holds a module to its manifest's schemas; ``None`` when it declares neither.

    Parameters:
        wasm: the module (manifest embedded).
        settings: the daemon's host and the tenant's limits (default: ``daemon_settings()``).
        case_inputs: ``(label, input)`` of the cases file: every value they give is checked
            against ``result_schema``.

    Raises:
        EvaldError: ``INVALID_MODULE`` when the module does not load.
    """
    settings = settings or daemon_settings()
    with WasmHost(settings.host) as host:
        module = host.load(wasm, limits=settings.limits)
        manifest = module.manifest
        if manifest.input_schema is None and manifest.result_schema is None:
            return None
        check = (_validator(manifest.input_schema), _validator(manifest.result_schema))

        def run(data: bytes) -> EvalOutcome:
            return _evaluate(host, module, data, settings)

        problems: list[str] = []
        if not manifest.examples:
            problems.append(
                "the manifest declares a schema but no examples: add examples (input and "
                "value, as JSON text) for evald test to check against it"
            )
        for index, example in enumerate(manifest.examples):
            outcome = run(example["input"].encode())
            problems += _example_problems(index, example, outcome, check)
        for label, text in case_inputs:
            outcome = run(text.encode())
            if outcome.error is None and outcome.value is not None:
                problem = _value_problem(label, outcome.value, check[1])
                problems += [problem] if problem else []
        for data in MALFORMED_INPUTS:
            problem = _malformed_problem(data, run(data))
            problems += [problem] if problem else []
    checks = len(manifest.examples) + len(case_inputs) + len(MALFORMED_INPUTS)
    return PolicyReport(checks, tuple(problems))


def _evaluate(
    host: WasmHost, module: LoadedModule, data: bytes, settings: DaemonSettings
) -> EvalOutcome:
    return host.evaluate(module, data, settings.limits, pool_key=settings.tenant or "")
