"""The invariants a fuzz run checks on every response.

A run fails on any :class:`Violation`. The kinds:

``crash``            the daemon process exited (outside a planned kill -9)
``hang``             the daemon stopped answering its health service, or a call got no answer
                     within its deadline (the gRPC client gave up)
``untyped_error``    a call failed without an ``evald-error-code``, or a result carried neither a
                     value nor a known error code
``internal_error``   the daemon answered ``internal`` (a bug, by definition)
``missing_result``   a batch or stream did not return one result per item, or ids do not match
``fuel_escape``      ``fuel_used`` above the tenant's fuel limit
``deadline_escape``  ``eval_time_us`` above the effective deadline plus the margin, again when
                     the evaluation is repeated (a time over the bound that does not reproduce
                     is a stall of the machine, counted as such; a host that fails to stop a
                     guest fails every time)
``memory_escape``    a guest saw more linear memory than its tenant's limit
``output_escape``    a value longer than the tenant's output limit
``input_escape``     an input over the tenant's input limit was evaluated
``tenant_leak``      a response carried another tenant's canary (a secret input, module name or
                     token), or a foreign module was listed, called or deleted
``call_leak``        under ``isolation = "fresh"``, a call found what an earlier call left in the
                     guest (the ``remember`` module's global or heap)
``rss_bound``        the daemon's resident memory went over the bound
``bad_value``        a value that does not match its evaluator's result regex
``unexpected``       an outcome the scenario rules out (a malicious module registered, a loop
                     that returned a value, a refusal with the wrong code)
``fault``            a fault scenario did not end as it must (no ``unavailable`` within the
                     deadline, no recovery after restart, modules lost, a half-written store)

Checks are plain functions of their inputs (the unit tests feed them crafted responses); what
they find goes to the run's tally (:mod:`evald_lab.fuzz.tally`), which the report is made from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from evald.contract import ErrorCode, pb
from evald.testing import REMEMBERED_NOTHING

__all__ = [
    "LIMIT_ESCAPES",
    "VIOLATION_KINDS",
    "Canaries",
    "Checker",
    "TenantBounds",
    "Violation",
    "outcome_label",
]

VIOLATION_KINDS = (
    "crash",
    "hang",
    "untyped_error",
    "internal_error",
    "missing_result",
    "fuel_escape",
    "deadline_escape",
    "memory_escape",
    "output_escape",
    "input_escape",
    "tenant_leak",
    "call_leak",
    "rss_bound",
    "bad_value",
    "unexpected",
    "fault",
)
#: The kinds that mean a limit did not hold.
LIMIT_ESCAPES = frozenset(
    {
        "fuel_escape",
        "deadline_escape",
        "memory_escape",
        "output_escape",
        "input_escape",
        "rss_bound",
    }
)
_SAMPLE_CHARS = 160
_KNOWN_CODES = frozenset(range(1, len(ErrorCode) + 1))


def _sample(data: bytes | str) -> str:
    text = repr(data[:_SAMPLE_CHARS])
    more = len(data) - _SAMPLE_CHARS
    return f"{text}... ({len(data)} bytes)" if more > 0 else text


@dataclass(frozen=True)
class Violation:
    """One broken invariant: what kind, in which input class, what happened, on what input."""

    kind: str
    klass: str
    detail: str
    sample: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "class": self.klass,
            "detail": self.detail,
            "sample": self.sample,
        }


@dataclass(frozen=True)
class TenantBounds:
    """The limits one tenant runs under (from the daemon's config)."""

    name: str
    fuel: int
    deadline_ms: int
    memory_bytes: int
    input_bytes: int
    output_bytes: int

    def effective_deadline_ms(self, requested_ms: int) -> int:
        """``min(requested, limit)``, the tenant's limit when nothing was requested."""
        return min(requested_ms, self.deadline_ms) if requested_ms else self.deadline_ms


@dataclass
class Canaries:
    """Secrets per tenant: no response to any other tenant may contain one of them."""

    by_tenant: dict[str, set[str]] = field(default_factory=dict)

    def add(self, tenant: str, *secrets: str) -> None:
        self.by_tenant.setdefault(tenant, set()).update(s for s in secrets if s)

    def foreign(self, tenant: str) -> list[str]:
        """Every secret that belongs to a tenant other than ``tenant``."""
        return [s for name, values in self.by_tenant.items() if name != tenant for s in values]

    def leaked(self, tenant: str, text: str, *, echoed: Iterable[str] = ()) -> str | None:
        """The first foreign secret found in ``text`` (``echoed`` strings — what the caller sent
        itself — are removed first), or None."""
        for part in echoed:
            if part:
                text = text.replace(part, "")
        for secret in self.foreign(tenant):
            if secret in text:
                return secret
        return None


def outcome_label(response: pb.EvaluateResponse) -> str:
    """``ok``, an error code name, or ``untyped`` when the response carries neither."""
    kind = response.WhichOneof("outcome")
    if kind == "value":
        return "ok"
    if kind == "error" and response.error.code in _KNOWN_CODES:
        return ErrorCode.from_proto(response.error.code).value
    return "untyped"


#: Codes that refuse a call before its input is read: an oversized input may get these instead of
#: ``input_too_large``.
_REFUSED_BEFORE_INPUT = frozenset(
    {
        ErrorCode.INPUT_TOO_LARGE.value,
        ErrorCode.UNKNOWN_EVALUATOR.value,
        ErrorCode.PERMISSION_DENIED.value,
        ErrorCode.QUOTA_EXCEEDED.value,
    }
)


class Checker:
    """Checks responses against the tenants' bounds, canaries and result regexes.

    Parameters:
        bounds: per tenant name.
        canaries: the per-tenant secrets.
        margin_ms: slack on deadlines (scheduling on a busy machine, the epoch tick).
        result_regex: per evaluator name, the manifest's ``result_regex`` (values are checked
            against it; an evaluator not listed is not checked).
    """

    def __init__(
        self,
        bounds: Mapping[str, TenantBounds],
        canaries: Canaries,
        *,
        margin_ms: float,
        result_regex: Mapping[str, str] | None = None,
    ) -> None:
        self.bounds = dict(bounds)
        self.canaries = canaries
        self.margin_ms = margin_ms
        self._regex: dict[str, re.Pattern[str] | None] = {}
        for name, pattern in (result_regex or {}).items():
            self.set_result_regex(name, pattern)

    def set_result_regex(self, evaluator: str, pattern: str) -> None:
        try:
            self._regex[evaluator] = re.compile(pattern)
        except re.error:
            self._regex[evaluator] = None  # XGrammar syntax Python cannot read: not checked

    def evaluation(
        self,
        klass: str,
        tenant: str,
        request: pb.EvaluateRequest,
        response: pb.EvaluateResponse | None,
    ) -> list[Violation]:
        """Every invariant of one evaluation's result: its id and type, the tenant's limits, the
        value's language, and no other tenant's secret."""
        sample = _sample(request.input)
        if response is None:
            return [Violation("missing_result", klass, f"no result for id {request.id!r}", sample)]
        label = outcome_label(response)
        return [
            *self._shape(klass, request, response, label, sample),
            *self._limits(klass, tenant, request, response, label, sample),
            *self._value_language(klass, request, response, label, sample),
            *self._leak(klass, tenant, request, response, label, sample),
        ]

    @staticmethod
    def _shape(
        klass: str,
        request: pb.EvaluateRequest,
        response: pb.EvaluateResponse,
        label: str,
        sample: str,
    ) -> list[Violation]:
        """The result answers its request and is a value or a typed error, never ``internal``."""
        found: list[Violation] = []
        if response.id != request.id:
            found.append(
                Violation(
                    "missing_result",
                    klass,
                    f"result id {response.id!r} for request id {request.id!r}",
                    sample,
                )
            )
        if label == "untyped":
            found.append(
                Violation(
                    "untyped_error", klass, "a result with neither a value nor a code", sample
                )
            )
        elif label == ErrorCode.INTERNAL.value:
            found.append(
                Violation("internal_error", klass, f"internal: {response.error.message}", sample)
            )
        return found

    def _limits(
        self,
        klass: str,
        tenant: str,
        request: pb.EvaluateRequest,
        response: pb.EvaluateResponse,
        label: str,
        sample: str,
    ) -> list[Violation]:
        """Fuel, deadline (plus the margin), input and output size within the tenant's limits."""
        found: list[Violation] = []
        bounds = self.bounds[tenant]
        if bounds.fuel and response.fuel_used > bounds.fuel:
            found.append(
                Violation(
                    "fuel_escape",
                    klass,
                    f"fuel_used {response.fuel_used} > limit {bounds.fuel}",
                    sample,
                )
            )
        deadline_ms = bounds.effective_deadline_ms(request.deadline_ms)
        if self.over_deadline(tenant, request, response):
            found.append(
                Violation(
                    "deadline_escape",
                    klass,
                    f"eval_time {response.eval_time_us} us > deadline {deadline_ms} ms "
                    f"+ margin {self.margin_ms:g} ms ({label})",
                    sample,
                )
            )
        if len(request.input) > bounds.input_bytes and label not in _REFUSED_BEFORE_INPUT:
            found.append(
                Violation(
                    "input_escape",
                    klass,
                    f"a {len(request.input)}-byte input (limit {bounds.input_bytes}) got {label}",
                    sample,
                )
            )
        if label == "ok":
            size = len(response.value.encode("utf-8"))
            if size > bounds.output_bytes:
                found.append(
                    Violation(
                        "output_escape",
                        klass,
                        f"a {size}-byte value (limit {bounds.output_bytes})",
                        sample,
                    )
                )
        return found

    def _value_language(
        self,
        klass: str,
        request: pb.EvaluateRequest,
        response: pb.EvaluateResponse,
        label: str,
        sample: str,
    ) -> list[Violation]:
        """A value matches its evaluator's ``result_regex`` (when Python can read it)."""
        if label != "ok":
            return []
        pattern = self._regex.get(request.evaluator)
        value = response.value
        if pattern is None or pattern.fullmatch(value):
            return []
        return [
            Violation(
                "bad_value",
                klass,
                f"{request.evaluator} value {value[:80]!r} does not match its result_regex",
                sample,
            )
        ]

    def _leak(
        self,
        klass: str,
        tenant: str,
        request: pb.EvaluateRequest,
        response: pb.EvaluateResponse,
        label: str,
        sample: str,
    ) -> list[Violation]:
        """Neither the value nor the error message carries another tenant's secret (the
        tenant's own input, echoed back, does not count)."""
        text = response.value if label == "ok" else response.error.message
        leak = self.canaries.leaked(
            tenant, text, echoed=(request.evaluator, request.input.decode("utf-8", "replace"))
        )
        if leak is None:
            return []
        return [
            Violation(
                "tenant_leak",
                klass,
                f"a response to {tenant} carries another tenant's secret {leak[:24]!r}",
                sample,
            )
        ]

    def over_deadline(
        self, tenant: str, request: pb.EvaluateRequest, response: pb.EvaluateResponse
    ) -> bool:
        """Whether the evaluation took longer than its effective deadline plus the margin."""
        deadline_ms = self.bounds[tenant].effective_deadline_ms(request.deadline_ms)
        return response.eval_time_us > (deadline_ms + self.margin_ms) * 1000

    def batch(
        self,
        klass: str,
        tenant: str,
        requests: list[pb.EvaluateRequest],
        responses: list[pb.EvaluateResponse],
        *,
        ordered: bool,
    ) -> tuple[list[Violation], list[pb.EvaluateResponse | None]]:
        """Matches a batch's or stream's results to its requests (by position when ``ordered``,
        else by id) and checks each. Returns the violations and the matched results."""
        found: list[Violation] = []
        if ordered:
            matched: list[pb.EvaluateResponse | None] = list(responses[: len(requests)])
            matched += [None] * (len(requests) - len(matched))
        else:
            by_id: dict[str, pb.EvaluateResponse] = {}
            for response in responses:
                if response.id in by_id:
                    found.append(
                        Violation("missing_result", klass, f"two results for id {response.id!r}")
                    )
                by_id[response.id] = response
            matched = [by_id.pop(request.id, None) for request in requests]
            if by_id:
                found.append(
                    Violation("missing_result", klass, f"{len(by_id)} results for unknown ids")
                )
        if len(responses) != len(requests):
            found.append(
                Violation(
                    "missing_result",
                    klass,
                    f"{len(responses)} results for {len(requests)} items",
                )
            )
        for request, result in zip(requests, matched, strict=True):
            found.extend(self.evaluation(klass, tenant, request, result))
        return found, matched

    def text(
        self, klass: str, tenant: str, text: str, *, echoed: Iterable[str] = ()
    ) -> list[Violation]:
        """A call-level message, a listing, any text shown to ``tenant``: no foreign secret."""
        leak = self.canaries.leaked(tenant, text, echoed=echoed)
        if leak is None:
            return []
        return [
            Violation(
                "tenant_leak",
                klass,
                f"text shown to {tenant} carries another tenant's secret {leak[:24]!r}",
                _sample(text),
            )
        ]

    @staticmethod
    def call_error(
        klass: str, code: str | None, details: str, *, expected: Iterable[str] = ()
    ) -> list[Violation]:
        """A failed call: it must carry a typed code (one of ``expected`` when given)."""
        allowed = set(expected)
        if code is None:
            return [
                Violation("untyped_error", klass, f"call failed without a code: {details[:200]}")
            ]
        if code == ErrorCode.INTERNAL.value:
            return [Violation("internal_error", klass, f"call failed internal: {details[:200]}")]
        if allowed and code not in allowed:
            return [
                Violation(
                    "unexpected",
                    klass,
                    f"call refused with {code}, expected one of {sorted(allowed)}: {details[:200]}",
                )
            ]
        return []

    def memory_pages(self, klass: str, tenant: str, pages: int) -> list[Violation]:
        """A guest reported holding ``pages`` wasm pages: within the tenant's memory limit."""
        limit = self.bounds[tenant].memory_bytes
        if pages * 65536 > limit:
            return [
                Violation(
                    "memory_escape",
                    klass,
                    f"a guest of {tenant} held {pages} pages ({pages * 65536} bytes) > {limit}",
                )
            ]
        return []

    @staticmethod
    def nothing_survived(klass: str, tenant: str, value: str) -> list[Violation]:
        """``remember``'s answer under fresh isolation: nothing from an earlier call."""
        if value != REMEMBERED_NOTHING:
            return [
                Violation(
                    "call_leak",
                    klass,
                    f"a call of {tenant} found what an earlier call left: {value[6:46]!r}",
                    _sample(value),
                )
            ]
        return []

    @staticmethod
    def rss(rss_bytes: int, bound_bytes: int) -> list[Violation]:
        if rss_bytes > bound_bytes:
            return [
                Violation(
                    "rss_bound",
                    "daemon",
                    f"daemon RSS {rss_bytes / 2**20:.0f} MiB > bound {bound_bytes / 2**20:.0f} MiB",
                )
            ]
        return []

    def call_latency(
        self, klass: str, elapsed_s: float, bound_s: float, what: str
    ) -> list[Violation]:
        """A whole call's wall time: within its bound (its deadline plus the margin)."""
        limit = bound_s + self.margin_ms / 1000
        if elapsed_s > limit:
            return [
                Violation("hang", klass, f"{what} took {elapsed_s:.3f} s > bound {limit:.3f} s")
            ]
        return []
