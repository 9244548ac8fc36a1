"""Who a call is and what it may hold: authentication, per-tenant quotas and admission.

Why one module: every transport (gRPC calls, the gRPC gatekeeper before a body is read, the data
path's connections) must apply the same rules, and each rule must be written once. So:

* :meth:`Admission.tenant_for` maps a call's ``authorization`` metadata, and
  :meth:`Admission.tenant_for_token` a bearer token as the data path's HELLO carries it (hashed
  by :func:`~evald.contract.token_digest`, compared in constant time with every tenant's), or a
  tokenless unix-socket call to its tenant;
* :class:`Tenant` holds a tenant's live quota counters: evaluations in flight and its rate
  bucket (``max_concurrency``, ``rate_per_s``), calls in flight (``max_calls``: unary calls,
  streams and data connections alike) and its unread output bytes (``unread_bytes``, shared by
  its streams and data connections, with the waiters woken when room is freed);
* :meth:`Admission.enter` counts a call or a connection against its tenant's ``max_calls`` and
  its share of the transport's shared pool (:mod:`evald.daemon._shares`);
  :meth:`Admission.enter_unauthenticated` against the small pool of callers with no tenant yet;
* :meth:`Admission.check_batch_size` and :meth:`Admission.prepare` refuse what is too large or
  over quota with a typed error, and turn an admitted item into the scheduler's work item.

Refusals cost the daemon nothing it must clean up later: a refused item is answered at once
(its evaluation error is data), a refused call never counts as entered.
"""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from evald.contract import (
    TOKEN_ENV,
    ErrorCode,
    EvaldError,
    TokenError,
    bearer_token,
    pb,
    token_digest,
)
from evald.daemon._config import Config, TenantConfig, TenantLimits
from evald.daemon._gatekeeping import error_response
from evald.daemon._metrics import UNKNOWN_EVALUATOR_LABEL, Metrics
from evald.daemon._scheduler import TenantQueue, Work
from evald.daemon._shares import SharedPool, Slots
from evald.host import Limits

if TYPE_CHECKING:
    from evald.daemon._registry import Registry

__all__ = ["Admission", "Tenant", "Transport", "UnreadWaiter", "host_limits"]

#: The door a call came through: a gRPC call, or a data-path connection.
Transport = Literal["grpc", "data"]


def _metadata_token(metadata: Any) -> str | None:
    """The bearer token of a call's metadata (None: the call carries none).

    Raises:
        EvaldError: ``permission_denied``, the metadata is not ``Bearer TOKEN``.
    """
    try:
        return bearer_token(metadata)
    except TokenError as exc:
        raise EvaldError(ErrorCode.PERMISSION_DENIED, str(exc)) from None


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
    """Something that waits for room in its tenant's ``unread_bytes`` or ``request_bytes``: a
    stream or a data connection. ``wake`` may be called from any thread."""

    def wake(self) -> None: ...


class Tenant(TenantQueue):
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
        self._threads = threads
        self._lock = threading.Lock()
        self._inflight = 0
        # Calls and unread output are shared by the gRPC streams (event loop) and the data
        # path's connections (threads): both guarded by _lock, so one budget holds for both.
        self.calls = 0  # calls in flight: unary calls, open streams and data connections
        self.unread = 0  # output bytes reserved by its streams and data connections
        self.requests = 0  # request bytes held until their items are admitted
        # Woken (wake()) when unread bytes are freed: its streams and data connections.
        self.sinks: set[UnreadWaiter] = set()
        self._rate = config.limits.rate_per_s
        self._burst = float(config.limits.effective_burst)
        self._tokens = self._burst
        self._refilled = time.monotonic()
        # Read at scrape time: no metric update on the evaluation path.
        metrics.inflight.labels(config.name).set_function(lambda: self._inflight)

    def reconfigure(self, config: TenantConfig, *, shared: bool) -> None:
        """Takes a changed config of the same tenant (a live reload, the fleet store): its new
        limits apply to the next call, its counters (what is in flight now) carry over."""
        limits = host_limits(config.limits)
        with self._lock:
            self.config = config
            self.limits = limits
            self._by_deadline = {config.limits.deadline_ms: limits}
            self._rate = config.limits.rate_per_s
            self._burst = float(config.limits.effective_burst)
            self._tokens = min(self._tokens, self._burst)
        self.running_cap = config.limits.running_cap(self._threads, shared=shared)

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

    def reserve_request(self, size: int) -> bool:
        """Counts ``size`` bytes of a request about to be read (any thread); False when the
        tenant's ``request_bytes`` has no room for them (a lone request always fits, so a
        message within ``max_message_bytes`` never waits for nothing)."""
        with self._lock:
            if self.requests and self.requests + size > self.config.limits.request_bytes:
                return False
            self.requests += size
            return True

    def charge_request(self, size: int) -> None:
        """Counts ``size`` bytes of a request that has already arrived (gRPC reads a message
        whole before the daemon sees it): the tenant's next reads wait until it is below its
        ``request_bytes`` again."""
        with self._lock:
            self.requests += size

    def request_room(self) -> bool:
        """Whether the tenant may start reading another request."""
        return self.requests < self.config.limits.request_bytes

    def free_request(self, size: int) -> None:
        """Returns request bytes once their items are admitted, and wakes what waits."""
        if size:
            with self._lock:
                self.requests -= size
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
        self._threads = threads
        self._max_batch_items = config.server.max_batch_items
        self._listens_on_unix = config.server.is_unix
        #: The evaluators; set once they are loaded (:meth:`prepare` needs them).
        self.registry: Registry | None = None
        self.tenants: dict[str, Tenant] = {}
        self._tokened: list[tuple[bytes, Tenant]] = []
        self._tokenless: Tenant | None = None
        # Long-lived calls (streams, data connections) and the credential each came with, so
        # a revoked token ends them (:meth:`watch`).
        self._watch_lock = threading.Lock()
        self._watched: dict[int, tuple[Tenant, bytes | None, Callable[[EvaldError], None]]] = {}
        self._next_watch = 0
        self._index_tenants(config.tenants)
        server = config.server
        self._shared = {
            "grpc": SharedPool(
                server.max_concurrent_rpcs,
                self.tenants,
                setting="max_concurrent_rpcs",
                what="gRPC calls in flight",
            ),
            "data": SharedPool(
                server.data_max_connections,
                self.tenants,
                setting="data_max_connections",
                what="data-path connections",
            ),
        }
        # Streams to services that need no token (health Watch) may take half the open calls
        # at most: a flood of them leaves room for the probes' Check calls.
        self._open_streams = Slots(
            max(1, server.open_calls // 2),
            setting="half of open_calls",
            what="streams that need no token",
        )
        self._unauthenticated = {
            "grpc": Slots(server.open_calls, setting="open_calls", what="calls that need no token"),
            "data": Slots(
                server.data_unauthenticated_connections,
                setting="data_unauthenticated_connections",
                what="data-path connections that have not authenticated",
            ),
        }

    def _index_tenants(self, configs: Sequence[TenantConfig]) -> None:
        """Builds the tenant table and the token index from ``configs``, keeping the live state
        of tenants that stay. Each table is built whole and swapped in, so a reader on any
        thread sees the old table or the new one."""
        shared = len(configs) > 1
        tenants: dict[str, Tenant] = {}
        for config in configs:
            state = self.tenants.get(config.name)
            if state is None:
                state = Tenant(config, self._metrics, self._threads, shared=shared)
            else:
                state.reconfigure(config, shared=shared)
            tenants[config.name] = state
        self._tokened = [
            (bytes.fromhex(token_sha256), state)
            for state in tenants.values()
            for token_sha256 in state.config.token_sha256s
        ]
        self._tokenless = next((s for s in tenants.values() if s.config.tokenless), None)
        self.tenants = tenants

    def apply_tenants(self, configs: Sequence[TenantConfig]) -> list[str]:
        """Serves ``configs`` from now on (a live reload, a change in the fleet store): new
        tenants are admitted, changed limits apply to the next call, and every stream and
        data-path connection whose token no longer names its tenant is ended with
        ``unauthenticated`` (in band: a status, an ERROR frame).

        Returns:
            The names of the tenants whose open calls were ended.
        """
        self._index_tenants(configs)
        names = list(self.tenants)
        for pool in self._shared.values():
            pool.set_tenants(names)
        with self._watch_lock:
            watched = list(self._watched.values())
        ended: list[str] = []
        for tenant, digest, end in watched:
            if self._still_valid(tenant, digest):
                continue
            ended.append(tenant.name)
            end(
                EvaldError(
                    ErrorCode.UNAUTHENTICATED,
                    f"the token of tenant {tenant.name!r} was revoked (or the tenant removed); "
                    "this call is ended: reconnect with a valid token",
                )
            )
        return ended

    def tenants_configs(self) -> list[TenantConfig]:
        """The configs of the tenants served now."""
        return [state.config for state in self.tenants.values()]

    def _still_valid(self, tenant: Tenant, digest: bytes | None) -> bool:
        current = self.tenants.get(tenant.name)
        if current is not tenant:
            return False
        if digest is None:
            return tenant.config.tokenless
        return digest.hex() in tenant.config.token_sha256s

    def watch(
        self, tenant: Tenant, metadata: Any, end: Callable[[EvaldError], None]
    ) -> Callable[[], None]:
        """Remembers a long-lived call of ``tenant`` (a stream, a data-path connection) and the
        token in its ``metadata``: when that token is revoked, ``end`` is called (from the
        thread that applies the change) with the ``unauthenticated`` error. Returns the
        call's idempotent ``unwatch``.

        Raises:
            EvaldError: ``permission_denied``, the metadata is not ``Bearer TOKEN`` (never for
                metadata :meth:`tenant_for` accepted).
        """
        return self.watch_token(tenant, _metadata_token(metadata), end)

    def watch_token(
        self, tenant: Tenant, token: str | None, end: Callable[[EvaldError], None]
    ) -> Callable[[], None]:
        """:meth:`watch` for a call that presented ``token`` itself (a data-path HELLO; None:
        the tokenless call)."""
        digest = token_digest(token) if token else None
        with self._watch_lock:
            key = self._next_watch
            self._next_watch += 1
            self._watched[key] = (tenant, digest, end)
        if not self._still_valid(tenant, digest):  # revoked between its check and now
            self.unwatch(key)
            end(EvaldError(ErrorCode.UNAUTHENTICATED, "the token was revoked"))
        return lambda: self.unwatch(key)

    def unwatch(self, key: int) -> None:
        with self._watch_lock:
            self._watched.pop(key, None)

    def enter(self, tenant: Tenant, transport: Transport) -> Callable[[], None]:
        """Counts one call (a gRPC call, a data-path connection) of ``tenant``: against its
        ``max_calls`` and its share of the transport's pool. Returns the call's ``leave``
        (idempotent, any thread).

        Raises:
            EvaldError: ``quota_exceeded``, saying which bound was reached.
        """
        pool = self._shared[transport]
        tenant.enter_call()
        try:
            pool.take(tenant.name)
        except EvaldError:
            tenant.leave_call()
            raise
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                pool.give(tenant.name)
                tenant.leave_call()

        return leave

    def enter_unauthenticated(
        self, transport: Transport, *, stream: bool = False
    ) -> Callable[[], None]:
        """Counts one caller with no tenant (yet): a call to a service that needs no token (a
        ``stream`` of responses, such as a health Watch, in at most half of them), a data-path
        connection before its HELLO. Returns its ``leave`` (idempotent).

        Raises:
            EvaldError: ``unavailable`` when the transport's small pool for them is full.
        """
        taken = [self._unauthenticated[transport]]
        if stream:
            taken.append(self._open_streams)
        for index, slots in enumerate(taken):
            try:
                slots.take()
            except EvaldError:
                for held in taken[:index]:
                    held.give()
                raise
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                for slots in taken:
                    slots.give()

        return leave

    def tenant_for(self, metadata: Any, *, over_unix: bool) -> Tenant:
        """The tenant a call belongs to, from its metadata alone (what an interceptor sees
        before gRPC reads the request body): :meth:`tenant_for_token` of its bearer token.

        Raises:
            EvaldError: ``permission_denied`` with what to fix (also for metadata that is not
                ``Bearer TOKEN``).
        """
        return self.tenant_for_token(_metadata_token(metadata), over_unix=over_unix)

    def tenant_for_token(self, token: str | None, *, over_unix: bool) -> Tenant:
        """The tenant of a bearer ``token`` as a call presented it (None or empty: no token).

        The token is hashed and compared in constant time with every tenant's hash; a call
        without one is the tokenless tenant's only when it arrives over the unix socket.

        Raises:
            EvaldError: ``permission_denied`` with what to fix.
        """
        if not token:
            if self._tokenless is not None and over_unix:
                return self._tokenless
            where = "this unix socket" if self._listens_on_unix else "TCP"
            raise EvaldError(
                ErrorCode.PERMISSION_DENIED,
                f"no token: calls over {where} need `authorization: Bearer TOKEN` metadata "
                f"(evald call --token, or ${TOKEN_ENV})",
            )
        digest = token_digest(token)
        found: Tenant | None = None
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
        self, tenant: Tenant, request: pb.EvaluateRequest, index: int
    ) -> Work | pb.EvaluateResponse:
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
        limits = tenant.limits_for(request.deadline_ms)
        return Work(
            index=index,
            request_id=request.id,
            evaluator=evaluator,
            data=request.input,
            limits=limits,
            tenant=tenant,
            # A client's deadline runs from its request; the tenant's, from the run's start.
            due=time.monotonic() + request.deadline_ms / 1000 if request.deadline_ms else 0.0,
        )
