"""Which tenant a server request is evaluated for: one layer for SGLang, vLLM and the local engine.

A request names its tenant with per-request options (``evald_token``, ``evald_target``,
``evald_evaluators``; read by :mod:`engine_adapter.serving._request_options`).
:class:`TenantRuntimes` turns those options into the
:class:`~engine_adapter.serving._server_runtime.AdapterRuntime` that
evaluates the request's spans, and is the only place that decides (docs/design.md, "Tenants in
a server process"):

- **Who gets the server's own tenant.** Only a request that names no token and goes to the
  server's own address (``EVALD_TARGET``, ``EVALD_TOKEN``). A named token that is empty, blank
  or malformed answers ``permission_denied`` in band; a request to another allowed address
  without a token sends none there.
- **Who takes a slot.** A token takes one of :data:`DEFAULT_MAX_TENANTS` slots only once evald
  has accepted it. Until then the tenant is *provisional*: its spans wait (without blocking
  the scheduler) while a background thread asks evald (``ListEvaluators``, which also brings
  the tenant's evaluators, its name and the daemon's revision). Each evald address has a
  checking thread and a queue of its own, so an address that hangs delays only the checks of
  tokens sent there: at most :data:`DEFAULT_MAX_CHECKING` tenants wait per address, newest
  first; past that the oldest waiting one is answered ``unavailable``. A check gets
  :data:`DEFAULT_CONNECT_TIMEOUT_S` to connect and answer a health ``Check``; an address that
  did not answer is remembered for :data:`DEFAULT_UNREACHABLE_S`, in which its waiting and new
  tenants are answered ``unavailable`` without a check. A refused token is remembered, by a
  salted digest and for :data:`DEFAULT_REFUSED_S`, in a table of at most
  :data:`DEFAULT_REFUSED_KEPT` entries: a flood of made-up tokens costs its own requests their
  answers, never a real tenant its slot.
- **Who is evicted.** When a token is accepted past the cap, the least recently used token of
  the *party* that holds the most slots (the newcomer's counted): a party with many tokens
  evicts only its own, and a new party takes a slot from the largest. A party is one evald
  tenant: the address and the tenant's name, which ``ListEvaluators`` tells the caller
  (``ListEvaluatorsResponse.tenant``, the token's own tenant), so all tokens of one tenant are
  one party and two tenants never are, whatever evaluators they see. Only a daemon older than
  that field names no tenant; its tokens are grouped, as well as the adapter can tell, by the
  evaluators they grant (their manifests), so two tenants of such a daemon that see exactly
  the same evaluators share a party and its slots, least recently used first. Any tenant idle
  for :data:`DEFAULT_IDLE_S` is evicted too (its connection is closed; a request still
  holding its runtime reconnects).
- **When evaluator specs are refreshed.** With ``refresh_s`` set (SGLang, which lowers
  ``evaluated_tag`` on the server), a background thread lists each recently used tenant's
  evaluators every ``refresh_s``; a new daemon revision replaces the specs and bumps
  :attr:`AdapterRuntime.revision`, which keys the tenant's grammars, so a grammar lowered from
  an old spec is not reused for new requests. Nothing here blocks a scheduler thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.evaluation import EvaluatorListing, TokenCodec
from engine_adapter.serving._request_options import allowed_targets, request_options
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.serving._server_runtime import AdapterRuntime, answering
from engine_adapter.spans import SpanBinding
from evald.contract import ErrorCode

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_IDLE_S",
    "DEFAULT_MAX_CHECKING",
    "DEFAULT_MAX_TENANTS",
    "DEFAULT_REFRESH_S",
    "DEFAULT_REFUSED_KEPT",
    "DEFAULT_REFUSED_S",
    "DEFAULT_UNREACHABLE_S",
    "Tenancy",
    "TenantRuntimes",
]

logger = logging.getLogger("engine_adapter")

#: Accepted tenants (evald address and token pairs) one server process keeps at most; each has
#: its own connection to evald.
DEFAULT_MAX_TENANTS = 256
#: An accepted tenant unused this long is evicted (its connection closed).
DEFAULT_IDLE_S = 600.0
#: Tenants waiting for evald to accept their token, at most, per evald address (newest checked
#: first).
DEFAULT_MAX_CHECKING = 256
#: Refused tokens remembered at most (salted digests, not tokens), and for how long.
DEFAULT_REFUSED_KEPT = 4096
DEFAULT_REFUSED_S = 30.0
#: How often a recently used tenant's evaluator list is refreshed (where specs are used).
DEFAULT_REFRESH_S = 5.0
#: How long one ``ListEvaluators`` check may take.
CHECK_TIMEOUT_S = 5.0
#: How long a check waits for evald to connect and answer a health ``Check``
#: (:func:`~engine_adapter.serving._server_runtime.answering`): an address that accepts and never
#: answers costs its check this, not :data:`CHECK_TIMEOUT_S`.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
#: An address whose check got no answer is answered ``unavailable`` for this long, without a
#: check (long enough that a hung address costs one thread a fraction of the time; short enough
#: that tenants of a restarted evald wait no longer than its restart).
DEFAULT_UNREACHABLE_S = 2.0

#: What evald answered that means "this token grants nothing" (remembered, not retried).
_REFUSING_CODES = frozenset({ErrorCode.PERMISSION_DENIED, ErrorCode.UNAUTHENTICATED})
#: Distinct refusal messages kept as shared refusing runtimes.
_REFUSALS_KEPT = 64

Check = Callable[[AdapterConfig], EvaluatorListing]
Key = tuple[str, str | None]
"""A tenant: ``(evald address, token)``."""


@dataclass(frozen=True)
class _Refused:
    code: str
    message: str
    reached: bool = True
    """False: nobody answered at the address (not a refusal of this token)."""


@dataclass
class _Checks:
    """One evald address's checks: its own queue and thread, so a hung address delays no
    other address's tenants."""

    waiting: collections.OrderedDict[Key, AdapterRuntime] = field(
        default_factory=collections.OrderedDict
    )
    checking: tuple[Key, AdapterRuntime] | None = None
    unreachable: tuple[float, str] | None = None
    """``(until, message)`` after a check got no answer: new tenants there are answered then."""


def _party(target: str, listing: EvaluatorListing) -> bytes:
    """Which party a token belongs to: its address and the tenant evald names for it.

    A daemon older than ``ListEvaluatorsResponse.tenant`` names none (an empty name; evald
    refuses an empty tenant name): then the evaluators the token grants stand in for it (the
    same for every token of one tenant, but also for two tenants that see the same ones). The
    two kinds of party are digested apart, so neither can take the other's value.
    """
    digest = hashlib.blake2b(target.encode("utf-8", "surrogateescape"), digest_size=16)
    if listing.tenant:
        digest.update(b"\0tenant\0" + listing.tenant.encode("utf-8", "surrogateescape"))
        return digest.digest()
    digest.update(b"\0evaluators\0")
    for spec in sorted(
        (s.name, s.tag, s.version, s.semantics_version, s.description, s.input_grammar,
         s.result_regex)
        for s in listing.evaluators
    ):  # fmt: skip
        digest.update(repr(spec).encode("utf-8", "surrogateescape"))
    return digest.digest()


@dataclass(frozen=True)
class Tenancy:
    """What :meth:`TenantRuntimes.for_request` decided for one request."""

    runtime: AdapterRuntime
    """Evaluates its spans: the tenant's (maybe still provisional), or one that refuses."""
    bindings: tuple[SpanBinding, ...]
    """The request's spans, renamed by its ``evald_evaluators``."""

    @property
    def refusal(self) -> tuple[str, str] | None:
        return self.runtime.refusal


class TenantRuntimes:
    """The tenants one server process evaluates for (thread-safe).

    Parameters:
        config: the server's settings (``EVALD_*``): its own address and token.
        codec: the tokenizer's codec, shared by every tenant.
        allowed: the addresses a request may name (default: :func:`allowed_targets`).
        max_tenants, idle_s: the cap on accepted tenants and the idle time that evicts one.
        max_checking: tenants waiting for evald's answer, at most, per address.
        refused_kept, refused_s: the bound and lifetime of the refused-token memory.
        refresh_s: how often recently used tenants' evaluator specs are re-listed (None: never;
            for engines that receive lowered tags and use no specs).
        connect_timeout_s: how long the default check waits for a connection to evald.
        unreachable_s: how long an address whose check got no answer answers ``unavailable``.
        check: asks evald about a tenant (default: ``ListEvaluators`` with its token,
            :func:`~engine_adapter.evaluation.tenant_listing`).
        runtime_factory: builds the server's own tenant's runtime (tests pass a stand-in
            evaluator); the default shares the process-wide client.
    """

    def __init__(
        self,
        config: AdapterConfig,
        codec: TokenCodec,
        *,
        allowed: frozenset[str] | None = None,
        max_tenants: int = DEFAULT_MAX_TENANTS,
        idle_s: float = DEFAULT_IDLE_S,
        max_checking: int = DEFAULT_MAX_CHECKING,
        refused_kept: int = DEFAULT_REFUSED_KEPT,
        refused_s: float = DEFAULT_REFUSED_S,
        refresh_s: float | None = DEFAULT_REFRESH_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        unreachable_s: float = DEFAULT_UNREACHABLE_S,
        check: Check | None = None,
        runtime_factory: Callable[[AdapterConfig], AdapterRuntime] | None = None,
    ) -> None:
        if min(max_tenants, max_checking, refused_kept) < 1:
            raise ValueError("max_tenants, max_checking and refused_kept must be at least 1")
        self.config = config
        self.codec = codec
        self.allowed = allowed if allowed is not None else allowed_targets(config)
        self.max_tenants = max_tenants
        self.idle_s = idle_s
        self.max_checking = max_checking
        self.refused_kept = refused_kept
        self.refused_s = refused_s
        self.refresh_s = refresh_s
        self.connect_timeout_s = connect_timeout_s
        self.unreachable_s = unreachable_s
        self._check = check or self._list_with_token
        factory = runtime_factory or (lambda cfg: AdapterRuntime(cfg, codec))
        self.default = factory(config)
        """The server's own tenant (``EVALD_TOKEN`` at ``EVALD_TARGET``): never evicted."""
        self._salt = os.urandom(16)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._accepted: collections.OrderedDict[Key, AdapterRuntime] = collections.OrderedDict()
        self._parties: dict[Key, bytes] = {}
        """The party (:func:`_party`) of each accepted tenant."""
        self._checks: dict[str, _Checks] = {}
        """Per address a request may name (bounded by ``allowed``)."""
        self._refused: collections.OrderedDict[bytes, tuple[float, str, str]] = (
            collections.OrderedDict()
        )
        self._refusals: dict[tuple[str, str], AdapterRuntime] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._refreshing = False
        self.stats = collections.Counter[str]()
        """``accepted``, ``refused``, ``refused_cached``, ``dropped``, ``evicted``,
        ``unreachable`` (checks that got no answer), ``unreachable_cached`` (tenants answered
        from that memory), ``refreshed`` (approximate; for logs and tests)."""

    # ------------------------------------------------------------------ the one entry point

    def for_request(
        self, extra: Mapping[str, Any] | None, bindings: tuple[SpanBinding, ...] = ()
    ) -> Tenancy:
        """The runtime for a request whose per-request options are ``extra`` (never blocks).

        ``extra``: the request's ``custom_params`` / ``extra_args`` (None: it names nothing).
        """
        reading = request_options(extra, bindings, self.config, self.allowed)
        if reading.refusal is not None:
            return Tenancy(self._refusing(*reading.refusal), reading.bindings)
        config = reading.config
        key = (config.target, config.token)
        now = time.monotonic()
        if key == (self.config.target, self.config.token):
            self.default.last_used = now
            self._start_refresher()
            return Tenancy(self.default, reading.bindings)
        with self._lock:
            self._evict_idle(now)
            runtime = self._accepted.get(key)
            if runtime is not None:
                self._accepted.move_to_end(key)
            else:
                runtime = self._pending_locked(key) or self._remembered_locked(key, now)
                if runtime is not None and runtime.refusal is not None:
                    return Tenancy(runtime, reading.bindings)  # answered without a check
                runtime = runtime or self._provisional_locked(key, config)
            runtime.last_used = now
        self._start_refresher()
        return Tenancy(runtime, reading.bindings)

    def runtimes(self) -> list[AdapterRuntime]:
        """The server's own and every accepted tenant's runtime (for flushing and tests)."""
        with self._lock:
            return [self.default, *self._accepted.values()]

    def sizes(self) -> dict[str, int]:
        """How full each table is: ``accepted``, ``waiting`` (for evald's answer, every
        address), ``refused`` (remembered refusals)."""
        with self._lock:
            return {
                "accepted": len(self._accepted),
                "waiting": sum(
                    len(checks.waiting) + (checks.checking is not None)
                    for checks in self._checks.values()
                ),
                "refused": len(self._refused),
            }

    def parties(self) -> dict[bytes, int]:
        """Accepted tenants per party (see the module's docstring; for logs and tests)."""
        with self._lock:
            return dict(collections.Counter(self._parties.values()))

    def __len__(self) -> int:
        """Accepted tenants (the server's own not counted)."""
        with self._lock:
            return len(self._accepted)

    def close(self) -> None:
        """Stops the background threads and closes the tenants' connections."""
        self._stopping.set()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            threads, self._threads = self._threads, []
            waiting = [r for checks in self._checks.values() for r in checks.waiting.values()]
            retired = [*self._accepted.values(), *waiting]
            self._accepted.clear()
            self._parties.clear()
            for checks in self._checks.values():
                checks.waiting.clear()
        for runtime in waiting:
            runtime.refuse(ErrorCode.UNAVAILABLE, "the server is shutting down")
        for thread in threads:
            thread.join(timeout=CHECK_TIMEOUT_S + 1.0)
        for runtime in retired:
            runtime.retire()

    # ------------------------------------------------------------------ admission

    def _pending_locked(self, key: Key) -> AdapterRuntime | None:
        """The tenant's provisional runtime while its check waits or runs."""
        checks = self._checks.get(key[0])
        if checks is None:
            return None
        if checks.checking is not None and checks.checking[0] == key:
            return checks.checking[1]
        runtime = checks.waiting.get(key)
        if runtime is not None:
            checks.waiting.move_to_end(key)
        return runtime

    def _remembered_locked(self, key: Key, now: float) -> AdapterRuntime | None:
        """A refusing runtime when the answer is remembered: the token was refused, or its
        address got no answer a moment ago."""
        refused = self._refused.get(self._digest(key))
        if refused is not None and refused[0] > now:
            self.stats["refused_cached"] += 1
            return self._refusing_locked(refused[1], refused[2])
        checks = self._checks.get(key[0])
        if checks is not None and checks.unreachable is not None:
            until, message = checks.unreachable
            if until > now:
                self.stats["unreachable_cached"] += 1
                return self._refusing_locked(ErrorCode.UNAVAILABLE, message)
            checks.unreachable = None
        return None

    def _provisional_locked(self, key: Key, config: AdapterConfig) -> AdapterRuntime:
        runtime = AdapterRuntime(
            config, self.codec, admission=concurrent.futures.Future(), own_client=True
        )
        checks = self._checks.setdefault(config.target, _Checks())
        checks.waiting[key] = runtime
        while len(checks.waiting) > self.max_checking:
            _, dropped = checks.waiting.popitem(last=False)
            self.stats["dropped"] += 1
            dropped.refuse(
                ErrorCode.UNAVAILABLE,
                "evald did not get to this tenant's token in time (too many unchecked tokens "
                "at once); send the request again",
            )
        name = f"evald-tenant-check {config.target}"
        self._start_locked(name, functools.partial(self._check_loop, checks))
        self._wake.notify_all()
        return runtime

    def _check_loop(self, checks: _Checks) -> None:
        """Checks one address's waiting tenants, newest first, one at a time."""
        while True:
            with self._lock:
                while not checks.waiting and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                key, runtime = checks.waiting.popitem(last=True)  # newest first
                checks.checking = (key, runtime)
            try:
                self._admit(key, runtime, checks)
            except Exception:  # the checker must keep running
                logger.exception("evald adapter: checking a tenant failed")
                runtime.refuse(ErrorCode.INTERNAL, "checking the tenant failed")
            finally:
                with self._lock:
                    checks.checking = None

    def _admit(self, key: Key, runtime: AdapterRuntime, checks: _Checks) -> None:
        outcome = self._ask(runtime.config)
        if not isinstance(outcome, _Refused):
            with self._lock:
                self._accepted[key] = runtime
                self._accepted.move_to_end(key)
                self._parties[key] = _party(key[0], outcome)
                evicted = self._evict_past_cap_locked(key)
                self.stats["accepted"] += 1
            runtime.admit(outcome.evaluators, outcome.revision)
            for old in evicted:
                old.retire()
            return
        code, message = outcome.code, outcome.message
        stranded: list[AdapterRuntime] = []
        with self._lock:
            if code in _REFUSING_CODES:
                self._remember_refusal_locked(key, code, message)
                self.stats["refused"] += 1
            elif not outcome.reached:  # so are the others waiting there: answer them now
                checks.unreachable = (time.monotonic() + self.unreachable_s, message)
                stranded = list(checks.waiting.values())
                checks.waiting.clear()
                self.stats["unreachable"] += 1
        for waiting in (runtime, *stranded):
            waiting.refuse(code, message)

    def _evict_past_cap_locked(self, newcomer: Key) -> list[AdapterRuntime]:
        """Past the cap: the least recently used token of the party holding the most slots
        (the newcomer's counted, the newcomer itself spared)."""
        evicted: list[AdapterRuntime] = []
        while len(self._accepted) > self.max_tenants:
            held = collections.Counter(self._parties.values())
            most = max(held.values())
            victim = next(
                key
                for key in self._accepted  # least recently used first
                if key != newcomer and held[self._parties[key]] == most
            )
            evicted.append(self._drop_locked(victim))
            self.stats["evicted"] += 1
        return evicted

    def _drop_locked(self, key: Key) -> AdapterRuntime:
        self._parties.pop(key, None)
        return self._accepted.pop(key)

    def _ask(self, config: AdapterConfig) -> EvaluatorListing | _Refused:
        """evald's answer for a tenant: its listing, or why there is none."""
        from evald.client import CallError

        try:
            listing = self._check(config)
        except CallError as exc:
            if exc.code is None:
                return _Refused(
                    ErrorCode.UNAVAILABLE,
                    f"evald at {config.target} did not answer ({exc.message}); send the "
                    f"request again",
                    reached=False,
                )
            return _Refused(exc.code.value, exc.message)
        except Exception as exc:
            return _Refused(ErrorCode.UNAVAILABLE, f"evald at {config.target} failed: {exc}")
        return listing

    def _list_with_token(self, config: AdapterConfig) -> EvaluatorListing:
        """The default check: ``ListEvaluators`` with the tenant's token, once evald at the
        address has answered a probe within :attr:`connect_timeout_s`."""
        from engine_adapter.evaluation import tenant_listing

        target, token = config.target, config.token
        tls = {"tls_ca": config.tls_ca, "tls_cert": config.tls_cert, "tls_key": config.tls_key}
        with answering(target, self.connect_timeout_s, abandon=self._stopping, **tls):
            return tenant_listing(target, token, timeout_s=CHECK_TIMEOUT_S, **tls)

    def _remember_refusal_locked(self, key: Key, code: str, msg: str) -> None:
        digest = self._digest(key)
        self._refused[digest] = (time.monotonic() + self.refused_s, code, msg)
        self._refused.move_to_end(digest)
        while len(self._refused) > self.refused_kept:
            self._refused.popitem(last=False)

    def _digest(self, key: Key) -> bytes:
        digest = hashlib.blake2b(key=self._salt, digest_size=16)
        digest.update(repr(key).encode("utf-8", "surrogateescape"))
        return digest.digest()

    def _refusing(self, code: str, message: str) -> AdapterRuntime:
        with self._lock:
            return self._refusing_locked(code, message)

    def _refusing_locked(self, code: str, message: str) -> AdapterRuntime:
        """One shared refusing runtime per distinct refusal (a flood of one refusal compiles
        one grammar in SGLang's cache, not one per request)."""
        runtime = self._refusals.get((code, message))
        if runtime is None:
            if len(self._refusals) >= _REFUSALS_KEPT:
                self._refusals.clear()
            runtime = AdapterRuntime(self.config, self.codec, refusal=(code, message))
            self._refusals[(code, message)] = runtime
        return runtime

    # ------------------------------------------------------------------ eviction, refresh

    def _evict_idle(self, now: float) -> None:
        while self._accepted:
            key, runtime = next(iter(self._accepted.items()))
            if now - runtime.last_used < self.idle_s:
                return
            self._drop_locked(key)
            self.stats["evicted"] += 1
            threading.Thread(target=runtime.retire, daemon=True).start()

    def _start_refresher(self) -> None:
        if self.refresh_s is None or self._refreshing:
            return
        with self._lock:
            self._refreshing = True
            self._start_locked("evald-tenant-refresh", self._refresh_loop)

    def _start_locked(self, name: str, loop: Callable[[], None]) -> None:
        if self._closed or any(thread.name == name for thread in self._threads):
            return
        thread = threading.Thread(target=loop, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _refresh_loop(self) -> None:
        assert self.refresh_s is not None
        period = self.refresh_s
        while True:
            with self._lock:
                if self._wake.wait_for(lambda: self._closed, timeout=period):
                    return
                now = time.monotonic()
                self._evict_idle(now)
                due = [
                    (key, runtime)
                    for key, runtime in [((self.config.target, self.config.token), self.default),
                                         *self._accepted.items()]
                    if now - runtime.last_used < max(period * 4, 60.0)
                ]  # fmt: skip
            for key, runtime in due:
                self.refresh(key, runtime)

    def refresh(self, key: Key, runtime: AdapterRuntime) -> bool:
        """Re-lists one tenant's evaluators; a revoked token evicts the tenant.

        Returns whether the specs changed (a new daemon revision).
        """
        if runtime.refusal is not None:
            return False
        outcome = self._ask(runtime.config)
        if not isinstance(outcome, _Refused):
            revision = outcome.revision
            unchanged = revision == runtime.revision and runtime.revision
            runtime.set_listing(outcome.evaluators, revision)  # the held specs are current again
            if unchanged:
                return False
            with self._lock:
                if self._accepted.get(key) is runtime:  # a new revision: its party may differ
                    self._parties[key] = _party(key[0], outcome)
            self.stats["refreshed"] += 1
            return True
        code, message = outcome.code, outcome.message
        if code in _REFUSING_CODES and runtime is not self.default:
            with self._lock:
                if self._accepted.get(key) is runtime:
                    self._drop_locked(key)
                self._remember_refusal_locked(key, code, message)
            runtime.refuse(code, message)
            runtime.retire()
        return False
