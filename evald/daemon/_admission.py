"""Who a call is and what it may hold: authentication, per-tenant quotas and admission.

Why one module: every transport (gRPC calls, the gRPC gatekeeper before a body is read, the data
path's connections) must apply the same rules, and each rule must be written once. So:

* :meth:`Admission.tenant_for` / :meth:`Admission.authenticate` map a bearer token (hashed,
  compared in constant time with every tenant's) or a tokenless unix-socket call to its tenant;
* :class:`_TenantState` holds a tenant's live quota counters: evaluations in flight and its rate
  bucket (``max_concurrency``, ``rate_per_s``), calls in flight (``max_calls``: unary calls,
  streams and data connections alike) and its unread output bytes (``unread_bytes``, shared by
  its streams and data connections, with the waiters woken when room is freed);
* :meth:`Admission.check_batch_size` and :meth:`Admission.prepare` refuse what is too large or
  over quota with a typed error, and turn an admitted item into the scheduler's work item.

Refusals cost the daemon nothing it must clean up later: a refused item is answered at once
(its evaluation error is data), a refused call never counts as entered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from evald.contract import ErrorCode, EvaldError, pb
from evald.daemon._config import Config, TenantConfig, TenantLimits
from evald.daemon._gatekeeping import error_response
from evald.daemon._metrics import UNKNOWN_EVALUATOR_LABEL, Metrics
from evald.daemon._scheduler import TenantQueue, _Work
from evald.host import Limits

if TYPE_CHECKING:
    from evald.daemon._registry import Registry

__all__ = ["Admission", "UnreadWaiter", "host_limits"]


def host_limits(limits: TenantLimits) -> Limits:
    """The per-evaluation part of a tenant's limits, as the wasm host takes them.

    Shared with ``evald build`` and ``evald test``, so a module is checked there under exactly
    the limits the daemon would give it.
    """
    return Limits(
        fuel=limits.fuel,
        memory_bytes=limits.memory_bytes,
        deadline_ms=limits.deadline_ms,
        input_bytes=limits.input_bytes,
        output_bytes=limits.output_bytes,
        instance_cache_bytes=limits.instance_cache_bytes,
    )


class UnreadWaiter(Protocol):
    """Something that waits for room in its tenant's ``unread_bytes``: a stream or a data
    connection. ``wake`` may be called from any thread."""

    def wake(self) -> None: ...


class _TenantState(TenantQueue):
    """A tenant's live state: its config, host limits and quota counters (thread-safe).

    It is the tenant's :class:`~evald.daemon._scheduler.TenantQueue` too, so the scheduler reaches
    its scheduling counters with no indirection.
    """

    def __init__(
        self, config: TenantConfig, metrics: Metrics, threads: int, *, shared: bool = True
    ) -> None:
        super().__init__(config.name, config.limits.running_cap(threads, shared=shared))
        self.config = config
        self.limits = host_limits(config.limits)
        self._by_deadline: dict[int, Limits] = {config.limits.deadline_ms: self.limits}
        self._lock = threading.Lock()
        self._inflight = 0
        # Calls and unread output are shared by the gRPC streams (event loop) and the data
        # path's connections (threads): both guarded by _lock, so one budget holds for both.
        self.calls = 0  # calls in flight: unary calls, open streams and data connections
        self.unread = 0  # output bytes reserved by its streams and data connections
        # Woken (wake()) when unread bytes are freed: its streams and data connections.
        self.sinks: set[UnreadWaiter] = set()
        self._rate = config.limits.rate_per_s
        self._burst = float(config.limits.effective_burst)
        self._tokens = self._burst
        self._refilled = time.monotonic()
        # Read at scrape time: no metric update on the evaluation path.
        metrics.inflight.labels(config.name).set_function(lambda: self._inflight)

    def limits_for(self, requested_deadline_ms: int) -> Limits:
        """Host limits with deadline ``min(requested or tenant limit, tenant limit)``."""
        ceiling = self.config.limits.deadline_ms
        deadline_ms = min(requested_deadline_ms, ceiling) if requested_deadline_ms else ceiling
        limits = self._by_deadline.get(deadline_ms)
        if limits is None:
            limits = dataclasses.replace(self.limits, deadline_ms=deadline_ms)
            self._by_deadline[deadline_ms] = limits
        return limits

    def admit(self) -> str | None:
        """Admits one evaluation, or returns why it is refused (a ``quota_exceeded`` message)."""
        limits = self.config.limits
        with self._lock:
            if self._inflight >= limits.max_concurrency:
                return (
                    f"tenant {self.name!r} already has {self._inflight} evaluations in flight, "
                    f"its max_concurrency; retry when some finish"
                )
            if self._rate > 0:
                now = time.monotonic()
                self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self._rate)
                self._refilled = now
                if self._tokens < 1.0:
                    return (
                        f"tenant {self.name!r} exceeded its rate of {self._rate:g} evaluations/s "
                        f"(burst {self._burst:g}); retry later"
                    )
                self._tokens -= 1.0
            self._inflight += 1
        return None

    def release(self) -> None:
        """Ends one admitted evaluation (called once per admission, from any thread)."""
        with self._lock:
            self._inflight -= 1

    def enter_call(self) -> None:
        """Counts one call in flight (any thread): a unary call, a stream or a data connection.

        Raises:
            EvaldError: ``quota_exceeded`` at the tenant's ``max_calls``.
        """
        limit = self.config.limits.max_calls
        with self._lock:
            if self.calls >= limit:
                raise EvaldError(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"tenant {self.name!r} already has {self.calls} calls in flight (unary "
                    "calls, streams and data-path connections), its max_calls; retry when "
                    "some finish (or send more items per batch or stream)",
                )
            self.calls += 1

    def leave_call(self) -> None:
        with self._lock:
            self.calls -= 1

    def reserve_unread(self, size: int) -> bool:
        """Reserves ``size`` output bytes of the tenant's ``unread_bytes`` (any thread); False
        when they do not fit (a lone reservation always fits, so one large item never waits
        for nothing)."""
        bound = self.config.limits.unread_bytes
        with self._lock:
            if self.unread and self.unread + size > bound:
                return False
            self.unread += size
            return True

    def free_unread(self, size: int) -> None:
        """Returns output bytes to the tenant's budget (any thread) and wakes what waits for
        room: its streams and data connections."""
        if size:
            with self._lock:
                self.unread -= size
                waiters = list(self.sinks)
            for waiter in waiters:
                waiter.wake()

    def add_waiter(self, waiter: UnreadWaiter) -> None:
        with self._lock:
            self.sinks.add(waiter)

    def remove_waiter(self, waiter: UnreadWaiter) -> None:
        with self._lock:
            self.sinks.discard(waiter)


class Admission:
    """The daemon's tenants and the rules every call and item passes before it runs.

    Parameters:
        config: the daemon's config (its tenants and ``max_batch_items``).
        metrics: where refusals are counted.
        threads: the guest worker count (a tenant's default ``max_running`` derives from it).
    """

    def __init__(self, config: Config, metrics: Metrics, threads: int) -> None:
        self._metrics = metrics
        self._max_batch_items = config.server.max_batch_items
        self._listens_on_unix = config.server.is_unix
        #: The evaluators; set once they are loaded (:meth:`prepare` needs them).
        self.registry: Registry | None = None
        self.tenants = {
            tenant.name: _TenantState(tenant, metrics, threads, shared=len(config.tenants) > 1)
            for tenant in config.tenants
        }
        self._tokened = [
            (bytes.fromhex(state.config.token_sha256), state)
            for state in self.tenants.values()
            if not state.config.tokenless
        ]
        self._tokenless = next(
            (state for state in self.tenants.values() if state.config.tokenless), None
        )

    def authenticate(self, context: Any) -> _TenantState:
        """The tenant a call belongs to.

        A bearer token is hashed and compared in constant time with every tenant's hash; a call
        without one is the tokenless tenant's only when it arrives over the unix socket.

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        over_unix = str(context.peer()).startswith("unix:")
        return self.tenant_for(context.invocation_metadata(), over_unix=over_unix)

    def tenant_for(self, metadata: Any, *, over_unix: bool) -> _TenantState:
        """:meth:`authenticate` from the call's metadata alone (what an interceptor sees before
        gRPC reads the request body).

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        authorization: str | None = None
        for key, value in metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        if authorization is None:
            if self._tokenless is not None and over_unix:
                return self._tokenless
            where = "this unix socket" if self._listens_on_unix else "TCP"
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"no token: calls over {where} need `authorization: Bearer TOKEN` metadata "
                "(evald call --token, or $EVALD_TOKEN)",
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                "malformed authorization metadata: expected `Bearer TOKEN`",
            )
        digest = hashlib.sha256(token.strip().encode("utf-8")).digest()
        found: _TenantState | None = None
        for expected, state in self._tokened:
            if hmac.compare_digest(digest, expected):
                found = state
        if found is None:
            raise EvaldError(ErrorCode.PERMISSION_DENIED, "the token matches no tenant")
        return found

    def check_batch_size(self, items: int) -> None:
        """Refuses a message of more than ``max_batch_items`` items before any is admitted.

        Raises:
            EvaldError: ``invalid_argument``, saying to split the batch.
        """
        limit = self._max_batch_items
        if items > limit:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT,
                f"a batch carries {items} items, over the daemon's max_batch_items of {limit}; "
                "split it",
            )

    def prepare(
        self, tenant: _TenantState, request: pb.EvaluateRequest, index: int
    ) -> _Work | pb.EvaluateResponse:
        """Resolves and admits one evaluation, or answers it at once with the refusal."""
        registry = self.registry
        assert registry is not None, "the evaluators are not loaded yet"
        try:
            evaluator = registry.resolve(tenant.name, request.evaluator)
        except EvaldError as exc:
            self._metrics.observe_evaluation(
                tenant.name, UNKNOWN_EVALUATOR_LABEL, exc.code.value, 0, 0
            )
            return error_response(request.id, exc.code, exc.message)
        refusal = tenant.admit()
        if refusal is not None:
            self._metrics.observe_evaluation(
                tenant.name, evaluator.name, ErrorCode.QUOTA_EXCEEDED.value, 0, 0
            )
            return error_response(request.id, ErrorCode.QUOTA_EXCEEDED, refusal)
        return _Work(
            index=index,
            request_id=request.id,
            evaluator=evaluator,
            data=request.input,
            limits=tenant.limits_for(request.deadline_ms),
            tenant=tenant,
        )
