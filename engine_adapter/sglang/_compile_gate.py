"""Grammar compiles that never hold one of SGLang's compile threads while evald answers.

SGLang compiles a request's grammar on its backend's thread pool (``executor``, a
``ThreadPoolExecutor`` of ``min(32, cores + 4)`` threads: 6 on a 2-core machine), shared by every
request of the server, evaluated or not, and the scheduler admits the request once the compile's
future is done. Lowering an evaluated tag needs the tenant's evaluators, so a compile for a
tenant evald has not answered for yet (a first token check, an evald that is slow or stopped)
would wait for that answer *on a pool thread*: a few such tenants at once took every thread for
the check's whole timeout, and every other tenant's grammar, a plain JSON-schema request's
included, waited behind them (docs/sglang.md, "Where a plain request waits").

:class:`GatedExecutor` stands in for the pool: while the scheduler hook runs SGLang's own
``process_req_with_grammar`` inside :meth:`GatedExecutor.after`, a compile submitted then is
handed to the pool only once the tenant's answer is in
(:meth:`~engine_adapter.serving.AdapterRuntime.listing_ready`); SGLang holds the
returned future and polls it as it polls any compile. Nothing waits on a thread meanwhile, and a
compile whose future SGLang cancelled (its grammar timeout) never runs.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["GatedExecutor"]


class GatedExecutor:
    """SGLang's grammar-compile pool, with compiles that can wait for a gate off the pool.

    Parameters:
        pool: the backend's own executor; every compile still runs there.
    """

    def __init__(self, pool: concurrent.futures.Executor) -> None:
        self.pool = pool
        self._local = threading.local()

    @contextmanager
    def after(self, gate: concurrent.futures.Future[Any] | None) -> Iterator[None]:
        """Compiles submitted from this thread inside the block start once ``gate`` is done
        (``None``, or a done future: at once, as before)."""
        self._local.gate = gate
        try:
            yield
        finally:
            self._local.gate = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``Executor.submit``: the pool's own future, or one completed from it once the gate
        this thread is inside (:meth:`after`) is done."""
        gate: concurrent.futures.Future[Any] | None = getattr(self._local, "gate", None)
        if gate is None or gate.done():
            return self.pool.submit(fn, *args, **kwargs)
        outer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        gate.add_done_callback(lambda _: self._start(outer, fn, args, kwargs))
        return outer

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """``Executor.shutdown`` of the pool."""
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)

    def _start(
        self,
        outer: concurrent.futures.Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        if not outer.set_running_or_notify_cancel():
            return  # SGLang gave up on it (its grammar timeout, an abort)
        try:
            inner = self.pool.submit(fn, *args, **kwargs)
        except BaseException as exc:  # the pool is shut down: the request fails, not hangs
            outer.set_exception(exc)
            return
        inner.add_done_callback(lambda done: _copy(done, outer))


def _copy(done: concurrent.futures.Future[Any], outer: concurrent.futures.Future[Any]) -> None:
    if done.cancelled():
        outer.set_exception(concurrent.futures.CancelledError())
        return
    exc = done.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(done.result())
