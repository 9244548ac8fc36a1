"""``EvaluateStream``: one bidirectional gRPC stream, from its first message to its status.

Why a module of its own: a stream is the one call with two activities at once, a reader that
admits each message's items (through :class:`~evald.daemon._transport.Intake`, the algorithm the
data path runs too) and a sender that hands finished results to gRPC, and with a budget they
share (:class:`~evald.daemon._transport.OutputBudget`). Here each is a method of
:class:`_Stream`; the servicer (:mod:`evald.daemon._service`) authenticates and counts the call,
then calls :func:`serve_stream`.

Backpressure is in bytes: at the stream's or the tenant's bound the reader stops reading the
stream (HTTP/2 flow control then stalls the client), so a client that sends without reading can
make the daemon hold at most ``stream_unread_bytes``, and all of a tenant's streams its
``unread_bytes``; a client that then reads nothing for ``stream_stall_s`` is cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, cast

from evald.contract import ERROR_CODE_METADATA_KEY, ErrorCode, EvaldError, pb
from evald.daemon._admission import Tenant
from evald.daemon._gatekeeping import Malformed, pack_responses
from evald.daemon._scheduler import Batch, Work
from evald.daemon._transport import Admitted, Core, Intake, OutputBudget, shutting_down

__all__ = ["METHOD", "serve_stream"]

_log = logging.getLogger("evald.server")

#: The method's name in ``evald_rpcs``.
METHOD = "EvaluateStream"

_Result = tuple[pb.EvaluateResponse, int]  # a response and the output bytes reserved for it


class _Sink:
    """Where a stream's workers drop finished results; wakes the sender once per burst, and
    the reader when room was freed (:meth:`wake`, from any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._results: list[_Result] = []
        self.event = asyncio.Event()  # results to send, the reader ended, or the daemon stops
        self.room = asyncio.Event()  # room may have been freed in the output budget
        self._loop_thread = threading.get_ident()  # made on the loop's thread

    def wake(self) -> None:
        if threading.get_ident() == self._loop_thread:
            self.room.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self._loop.call_soon_threadsafe(self.room.set)

    def wake_to_stop(self) -> None:
        """The daemon stops (on the loop): the sender looks at ``Core.stopping``."""
        self.event.set()

    def put_threadsafe(self, work: Work, response: pb.EvaluateResponse) -> None:
        with self._lock:
            self._results.append((response, work.reserved))
            first = len(self._results) == 1
        if first:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                self._loop.call_soon_threadsafe(self.event.set)

    def put_local(self, responses: Iterable[_Result]) -> None:
        with self._lock:
            self._results.extend(responses)
        self.event.set()

    def take(self) -> list[_Result]:
        with self._lock:
            results, self._results = self._results, []
        return results


def _ignore_result(task: asyncio.Future[Any]) -> None:
    """Retrieves an abandoned task's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


class _Stream:
    """One stream's reader, sender and budget. :meth:`run` returns why it failed, if it did;
    :meth:`release` ends its work and gives its budget back (idempotent)."""

    def __init__(
        self,
        core: Core,
        tenant: Tenant,
        requests: AsyncIterator[Any],
        context: Any,
        on_end: Callable[[], None],
    ) -> None:
        self._core = core
        self._tenant = tenant
        self._requests = requests
        self._context = context
        self._on_end = on_end
        settings = core.settings
        self._stall_s = settings.stream_stall_s
        self._bound = settings.stream_unread_bytes
        self._max_message_bytes = settings.max_message_bytes
        self._loop = asyncio.get_running_loop()
        self._sink = _Sink(self._loop)
        self._budget = OutputBudget(tenant, self._bound, self._sink.wake)
        # Batches handed to the scheduler and not finished (release abandons them).
        self._batches: set[Batch] = set()
        self._reader: asyncio.Task[None] | None = None
        self._released = False
        self._idle_timeout_s = settings.idle_timeout_s
        self._revoked: EvaldError | None = None  # its token was revoked: end with this

    def revoke(self, error: EvaldError) -> None:
        """Ends the stream with ``error`` (its token was revoked); any thread. Results already
        handed to gRPC have gone; what is still running is abandoned."""

        def end() -> None:
            self._revoked = error
            if self._reader is not None:
                self._reader.cancel()
            self._sink.event.set()

        with contextlib.suppress(RuntimeError):  # the loop is gone: so is the stream
            self._loop.call_soon_threadsafe(end)

    async def run(self) -> EvaldError | None:
        """Reads and answers until the client is done and every result is sent."""
        reader = self._reader = self._loop.create_task(self._read())
        reader.add_done_callback(lambda _task: self._sink.event.set())
        self._core.track(self._sink)
        try:
            await self._send_until_done(reader)
        except EvaldError as exc:  # the client stopped reading
            return exc
        return self._why_reader_ended(reader)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._core.untrack(self._sink)
        if self._reader is not None:
            self._reader.cancel()
        batches, self._batches = self._batches, set()
        for batch in batches:
            self._core.abandon(batch, True)  # items no worker has taken: unavailable, freed
        self._budget.close()  # whatever was not sent goes back to the tenant
        self._on_end()

    # The reader ---------------------------------------------------------------------------

    async def _read(self) -> None:
        """Admits each message's items; returns when the client is done (or idle too long).

        gRPC hands over a message only once all of it has arrived, so its bytes are charged to
        the tenant's ``request_bytes`` then, until its items are admitted; while the tenant is
        past that budget, its streams read no further message.
        """
        messages = aiter(self._requests)
        tenant = self._tenant
        while True:
            while True:
                seen = self._budget.freed
                if tenant.request_room():
                    break
                await self._room(seen)
            message = await self._next_message(messages)
            if message is None:
                return
            if isinstance(message, Malformed):
                raise EvaldError(ErrorCode.INVALID_ARGUMENT, message.reason)
            size = message.ByteSize()
            tenant.charge_request(size)
            try:
                await self._admit(message)
            finally:
                tenant.free_request(size)

    async def _next_message(self, messages: AsyncIterator[Any]) -> Any:
        """The next message, or None when the client is done sending or the stream was idle
        (nothing in flight, nothing received) for ``idle_timeout_s``."""
        if self._idle_timeout_s <= 0:
            return await anext(messages, None)
        receiving = asyncio.ensure_future(anext(messages, None))
        while True:
            done, _ = await asyncio.wait((receiving,), timeout=self._idle_timeout_s)
            if done:
                return receiving.result()
            if self._budget.reserved <= 0:
                break  # idle: nothing owed either way
        receiving.add_done_callback(_ignore_result)
        receiving.cancel()
        _log.info("stream closed: idle", extra={"fields": {"tenant": self._tenant.name}})
        return None

    async def _admit(self, message: pb.EvaluateBatchRequest) -> None:
        intake = Intake(self._core, self._tenant, self._budget, message.items)
        while True:
            admitted = intake.advance()
            self._dispatch(admitted)
            if not admitted.blocked:
                return
            await self._room(admitted.seen)

    def _dispatch(self, admitted: Admitted) -> None:
        """Answers the refused items and hands the admitted ones to the scheduler.

        At once, not from a task: a task cancelled before its first step (the client cancels
        the stream as its message is admitted) never runs its body, so its items would stay
        admitted and never run, holding the tenant's quota for good. :meth:`release`
        abandons the batches that have not finished.
        """
        if admitted.refused:
            self._sink.put_local(admitted.refused)
        if not admitted.queue:
            return
        batch = Batch(self._loop, admitted.queue, self._sink.put_threadsafe)
        added, scheduled = self._core.enqueue(batch)
        if not scheduled or self._released:
            self._core.abandon(batch, added)
            return
        self._batches.add(batch)  # scheduled: it was added to its tenant's queue
        cast("asyncio.Future[None]", batch.done).add_done_callback(
            lambda _done: self._batches.discard(batch)
        )

    async def _room(self, seen: int) -> None:
        """Waits until room may have been freed since ``seen`` (the reader stops reading)."""
        room = self._sink.room
        while self._budget.freed == seen:
            room.clear()
            if self._budget.freed != seen:
                return
            await room.wait()

    def _why_reader_ended(self, reader: asyncio.Task[None]) -> EvaldError | None:
        if not reader.cancelled() and reader.exception() is not None:
            error = reader.exception()
            if isinstance(error, EvaldError):
                return error
            _log.error("stream reader failed", exc_info=error)
            return EvaldError(ErrorCode.INTERNAL, "internal error in the daemon")
        if self._core.stopping:
            return shutting_down()
        return None

    # The sender ---------------------------------------------------------------------------

    async def _send_until_done(self, reader: asyncio.Task[None]) -> None:
        sink = self._sink
        while True:
            await sink.event.wait()
            sink.event.clear()
            if self._revoked is not None:
                raise self._revoked
            results = sink.take()
            if results:
                for batch, freed in pack_responses(results, self._max_message_bytes):
                    await self._write(batch, freed)
            if self._core.stopping and not reader.done():
                reader.cancel()
            if reader.done() and self._budget.reserved <= 0:
                return

    async def _write(self, batch: list[pb.EvaluateResponse], freed: int) -> None:
        """Hands one message to gRPC, or cuts the stream off when it waits ``stream_stall_s``.

        Raises:
            EvaldError: ``quota_exceeded``: the client read nothing for ``stream_stall_s``.
        """
        # Not asyncio.wait_for: it waits without bound for the cancelled write.
        writing = self._loop.create_task(
            self._context.write(pb.EvaluateBatchResponse(results=batch))
        )
        done, _ = await asyncio.wait((writing,), timeout=self._stall_s)
        if not done:
            # The pending write would hold the status back until the client reads: drop it
            # (gRPC may have taken part of it; the call ends here either way).
            writing.add_done_callback(_ignore_result)
            writing.cancel()
            await asyncio.wait((writing,), timeout=1.0)
            unread = self._budget.reserved
            _log.info(
                "stream cut off: its client stopped reading",
                extra={"fields": {"tenant": self._tenant.name, "unread_bytes": unread}},
            )
            raise EvaldError(
                ErrorCode.QUOTA_EXCEEDED,
                f"the client read no results for {self._stall_s:g} s while {unread} bytes of "
                f"them waited (stream_unread_bytes is {self._bound}); the stream is ended: "
                "read results as they come",
            )
        writing.result()
        self._budget.release(freed)


async def serve_stream(
    core: Core,
    tenant: Tenant,
    requests: AsyncIterator[Any],
    context: Any,
    on_end: Callable[[], None],
) -> None:
    """Serves one authenticated stream to its end; ``on_end`` runs once its work is released
    (before a failure's status goes out: gRPC sends the status only after a message it has
    started, which a client that stopped reading may never take)."""
    stream = _Stream(core, tenant, requests, context, on_end)
    unwatch = core.watch(tenant, context.invocation_metadata(), stream.revoke)
    code = "ok"
    try:
        failure = await stream.run()
        if failure is not None:
            code = failure.code.value
            stream.release()
            await context.abort(
                failure.code.grpc_status,
                failure.message,
                trailing_metadata=((ERROR_CODE_METADATA_KEY, failure.code.value),),
            )
    except asyncio.CancelledError:
        code = "cancelled"
        raise
    finally:
        unwatch()
        stream.release()
        core.observe_call(METHOD, tenant.name, code)
