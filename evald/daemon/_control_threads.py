"""The daemon's two control-plane threads: one applies changes, one compiles and loads modules.

Why two: a change to what the daemon serves (a tenant, a token, a revocation, a registration's
commit, a deletion) takes milliseconds, but compiling or loading a module takes up to
``compile_timeout_s``. On one thread every revocation, ``SIGHUP`` and store change waited for
whatever module was compiling (5.6 s for a revocation committed while another tenant's module
compiled, against the documented p99 of 1 s), and a new daemon compiled every module of its
store before it bound its socket. So:

* the **control thread** (``evald-control``) applies every change, one at a time, in order:
  nothing that changes what the daemon serves runs anywhere else, so no two changes race;
* the **module thread** (``evald-modules``) compiles registrations (through the sandboxed
  compile worker) and loads the store's modules, one at a time (the compile worker compiles one
  module at a time anyway); what it produces is served by a job it hands to the control thread
  (:meth:`ControlThreads.schedule`), which checks again that it still applies.

A module's work never holds the control thread, and the control thread never waits for the
module thread. A tenant's change commits on the control thread only while the token of the call
that asked for it still names the tenant (:func:`still_names`): a registration sent with a
token revoked while it compiled changes nothing. The fleet store checks the token again inside
the change's own transaction (:class:`Recheck`'s ``token_sha256``), so a revocation committed
in the store after this check is not missed either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from evald.contract import ErrorCode, EvaldError
from evald.daemon._admission import Tenant

__all__ = ["ControlThreads", "Recheck", "still_names"]

_log = logging.getLogger("evald.server")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Recheck:
    """How a change's call is authenticated again when the change commits.

    ``authenticate`` reads the call's metadata again against the tenants served now;
    ``token_sha256`` is the hex SHA-256 of the token the call presented (None: it presented
    none, the tokenless unix-socket tenant's call). The fleet store is given the hash so that
    it checks, in the same transaction that writes the change, that the token still names the
    tenant: a revocation committed in the store after the daemon caught up orders before the
    change (refused) or after it, never in between.
    """

    authenticate: Callable[[], Tenant]
    token_sha256: str | None

    def __call__(self) -> Tenant:
        return self.authenticate()


class ControlThreads:
    """The control thread and the module thread (see the module); ``initializer`` runs first
    on each (the daemon pins them to its CPUs: the compile worker they start inherits them)."""

    def __init__(self, initializer: Callable[[], None] | None = None) -> None:
        self.control_pool = ThreadPoolExecutor(
            1, thread_name_prefix="evald-control", initializer=initializer
        )
        self.module_pool = ThreadPoolExecutor(
            1, thread_name_prefix="evald-modules", initializer=initializer
        )
        #: Set shortly before the shutdown grace ends: calls still waiting for either thread
        #: then end with ``unavailable`` (before gRPC cancels them untyped).
        self._cut_off: asyncio.Event | None = None

    def schedule(self, load: Callable[[], _T], apply: Callable[[_T], None]) -> None:
        """Runs ``load`` on the module thread, then ``apply(its result)`` on the control
        thread. Any thread; does not wait. Dropped without a word once the daemon stops."""

        def then(result: _T) -> None:
            try:
                apply(result)
            except Exception:
                _log.exception("applying a loaded module failed")

        def job() -> None:
            try:
                result = load()
            except Exception:
                _log.exception("loading a module failed")
                return
            try:
                self.control_pool.submit(then, result)
            except RuntimeError:  # the control thread is gone: the daemon stops
                pass

        try:
            self.module_pool.submit(job)
        except RuntimeError:  # the module thread is gone: the daemon stops
            pass

    async def control(self, function: Callable[..., _T], *args: Any) -> _T:
        """Runs a change on the control thread (see :meth:`_run`)."""
        return await self._run(self.control_pool, function, *args)

    async def modules(self, function: Callable[..., _T], *args: Any) -> _T:
        """Runs module work (a compilation) on the module thread (see :meth:`_run`)."""
        return await self._run(self.module_pool, function, *args)

    async def _run(self, pool: Executor, function: Callable[..., _T], *args: Any) -> _T:
        """Runs ``function`` on ``pool``'s thread and returns its result.

        Raises:
            EvaldError: ``unavailable`` when the daemon stops before the operation has run or
                finished (shortly before the shutdown grace ends; gRPC would otherwise cancel
                the call with an untyped ``CANCELLED``).
        """
        loop = asyncio.get_running_loop()
        if self._cut_off is None:
            self._cut_off = asyncio.Event()
        job = loop.run_in_executor(pool, function, *args)
        cut_off = asyncio.ensure_future(self._cut_off.wait())
        try:
            await asyncio.wait((job, cut_off), return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut_off.cancel()
        if not job.done():
            job.add_done_callback(_consume)
            raise EvaldError(
                ErrorCode.UNAVAILABLE,
                "the daemon is shutting down and the operation had not finished (it waited for "
                "the control thread); list the evaluators once the daemon is back to see whether "
                "it took effect",
            )
        return job.result()

    def cut_off_after(self, delay_s: float) -> None:
        """From ``delay_s`` on, calls waiting for either thread end ``unavailable`` (on the
        event loop)."""
        if self._cut_off is None:
            self._cut_off = asyncio.Event()
        asyncio.get_running_loop().call_later(max(0.0, delay_s), self._cut_off.set)

    def close(self) -> None:
        """Stops both threads (blocking): module work not begun is dropped, then the control
        thread finishes what it was given."""
        self.module_pool.shutdown(wait=True, cancel_futures=True)
        self.control_pool.shutdown(wait=True)


def still_names(tenant: Tenant, recheck: Recheck) -> Tenant:
    """``tenant`` as it is now, when the call's token still names it; ``recheck``
    authenticates the call's metadata again. Run on the control thread, where changes commit.

    Raises:
        EvaldError: ``permission_denied``: the token was revoked, or names another tenant (its
            tenant was removed and added again) since the call was authenticated.
    """
    try:
        current: Tenant | None = recheck()
    except EvaldError:
        current = None
    if current is None or current is not tenant:
        raise EvaldError(
            ErrorCode.PERMISSION_DENIED,
            f"the token this call was made with no longer names tenant {tenant.name!r} (it "
            "was revoked, or the tenant removed, while the call waited); nothing was changed",
        )
    return current


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieves the outcome of a job nobody waits for any more."""
    if not future.cancelled():
        future.exception()
