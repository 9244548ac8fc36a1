"""The fair scheduler on its own: no gRPC, no daemon, just batches, tenants and workers.

The scheduler does not care what an item does, so most tests give it a plain Python callable
that records who ran when (and sleeps, to take time the way a guest does without holding the
GIL); one test runs real ``WasmHost`` evaluations through it. What is checked: a flooding tenant
leaves the others their share, a worker moves on after a slice, no tenant holds more workers
than its cap, abandoning a batch answers its untaken items and gives their slots back, and
closing lets the workers finish what is queued while refusing new batches.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from evald.contract import ErrorCode, pb
from evald.daemon._gatekeeping import PROTO_CODES
from evald.daemon._registry import Evaluator
from evald.daemon._scheduler import SLICE_S, Batch, Scheduler, TenantQueue, Work
from evald.host import Limits, WasmHost
from evaluators_wasm import wasm_path

UNAVAILABLE = PROTO_CODES[ErrorCode.UNAVAILABLE]


class Tenant(TenantQueue):
    """A tenant whose admissions are counted, so a test sees each one released."""

    def __init__(self, name: str, running_cap: int) -> None:
        super().__init__(name, running_cap)
        self.released = 0
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self.released += 1


class Recorder:
    """A ``run`` callable: records (tenant, request id) as each item ends, and how many items of
    each tenant run at once; each item sleeps ``seconds[tenant]`` (default none)."""

    def __init__(self, seconds: dict[str, float] | None = None) -> None:
        self.seconds = seconds or {}
        self.finished: list[tuple[str, str]] = []
        self.running: collections.Counter[str] = collections.Counter()
        self.most_at_once: collections.Counter[str] = collections.Counter()
        self.total_at_once = 0
        self._total = 0
        self.gate: dict[str, threading.Event] = {}  # items with these ids wait for the event
        self.started: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, work: Work) -> pb.EvaluateResponse:
        name = work.tenant.name
        with self._lock:
            self.running[name] += 1
            self._total += 1
            self.most_at_once[name] = max(self.most_at_once[name], self.running[name])
            self.total_at_once = max(self.total_at_once, self._total)
        try:
            if work.request_id in self.started:
                self.started[work.request_id].set()
            if work.request_id in self.gate:
                assert self.gate[work.request_id].wait(10.0), "the test never opened the gate"
            seconds = self.seconds.get(name, 0.0)
            if seconds:
                time.sleep(seconds)
        finally:
            with self._lock:
                self.running[name] -= 1
                self._total -= 1
                self.finished.append((name, work.request_id))
        work.tenant.release()  # as the daemon's run does: the item's admission ends here
        return pb.EvaluateResponse(id=work.request_id, value=f"{name}:{work.request_id}")

    def done(self, name: str) -> int:
        with self._lock:
            return sum(1 for tenant, _ in self.finished if tenant == name)


def items(tenant: TenantQueue, count: int, prefix: str = "") -> collections.deque[Work]:
    """``count`` work items of ``tenant``; the callable, not the item, decides what runs."""
    evaluator: Any = None  # the Recorder never looks at it
    return collections.deque(
        Work(
            index=index,
            request_id=f"{prefix or tenant.name}-{index}",
            evaluator=evaluator,
            data=b"",
            limits=Limits(),
            tenant=tenant,
        )
        for index in range(count)
    )


class Delivered:
    """A batch's ``deliver``: every response by request id, and an event once all arrived."""

    def __init__(self, count: int) -> None:
        self.responses: dict[str, pb.EvaluateResponse] = {}
        self.count = count
        self.all = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, work: Work, response: pb.EvaluateResponse) -> None:
        with self._lock:
            assert work.request_id not in self.responses, "an item was answered twice"
            self.responses[work.request_id] = response
            if len(self.responses) == self.count:
                self.all.set()


def submit(
    scheduler: Scheduler, tenant: TenantQueue, count: int, prefix: str = ""
) -> tuple[Batch, Delivered]:
    """Enqueues a loop-less batch (as the data path does) and returns it with its results."""
    delivered = Delivered(count)
    batch = Batch(None, items(tenant, count, prefix), delivered)
    added, scheduled = scheduler.enqueue(batch)
    assert added and scheduled
    return batch, delivered


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.0005)


@pytest.fixture
def make() -> Iterator[Callable[..., Scheduler]]:
    """Schedulers whose pools are shut down after the test, whatever it left queued."""
    made: list[Scheduler] = []

    def build(run: Callable[[Work], pb.EvaluateResponse], workers: int) -> Scheduler:
        scheduler = Scheduler(run, workers)
        made.append(scheduler)
        return scheduler

    yield build
    for scheduler in made:
        scheduler.close_scheduler()
        scheduler.pool.shutdown(wait=True)


def test_a_flooding_tenant_leaves_the_other_its_share(make: Callable[..., Scheduler]) -> None:
    """One worker, two tenants: the flood's items take time, the other's arrive later; the
    late tenant is served within about one slice, long before the flood is through."""
    run = Recorder({"flood": 0.001})
    scheduler = make(run, 1)
    flood, other = Tenant("flood", 1), Tenant("other", 1)
    _, flooded = submit(scheduler, flood, 300)
    wait_until(lambda: run.done("flood") >= 3)
    _, served = submit(scheduler, other, 20)
    assert served.all.wait(10.0)
    # A slice is 2 ms of 1 ms items: the other tenant waits about two of them. Starved, it would
    # wait for all 300.
    assert run.done("flood") < 100, run.done("flood")
    assert flooded.all.wait(30.0)
    assert {r.value for r in served.responses.values()} == {f"other:other-{i}" for i in range(20)}
    assert flood.released == 300 and other.released == 20


def test_a_worker_moves_to_the_next_tenant_after_a_slice(make: Callable[..., Scheduler]) -> None:
    """With one worker and two busy tenants, completions alternate in runs of about one slice
    each: a large batch never holds the worker to its end."""
    step_s = 0.0005
    run = Recorder({"a": step_s, "b": step_s})
    scheduler = make(run, 1)
    a, b = Tenant("a", 1), Tenant("b", 1)
    gate = threading.Event()
    run.gate["a-0"] = gate  # hold the worker until both batches are queued
    _, first = submit(scheduler, a, 100)
    _, second = submit(scheduler, b, 100)
    gate.set()
    assert first.all.wait(20.0) and second.all.wait(20.0)
    runs = [len(list(group)) for group in _groups(name for name, _ in run.finished)]
    per_slice = SLICE_S / step_s + 1  # items that fit a slice, plus the one that crosses its end
    assert len(runs) >= 10, runs  # interleaved, not one tenant's batch after the other's
    assert max(runs) <= 4 * per_slice, runs
    assert max(runs) >= 2, runs  # but a slice runs several items per hand-off


def _groups(names: Iterable[str]) -> Iterator[list[str]]:
    group: list[str] = []
    for name in names:
        if group and group[-1] != name:
            yield group
            group = []
        group.append(name)
    if group:
        yield group


def test_no_tenant_holds_more_workers_than_its_cap(make: Callable[..., Scheduler]) -> None:
    """Four workers; tenant ``a`` may hold two, ``b`` three: each reaches its cap and never
    passes it, and together they never use more than the four workers."""
    run = Recorder({"a": 0.003, "b": 0.003})
    scheduler = make(run, 4)
    a, b = Tenant("a", 2), Tenant("b", 3)
    batches = [submit(scheduler, a, 40, "a0"), submit(scheduler, b, 40, "b0")]
    batches += [submit(scheduler, a, 20, "a1"), submit(scheduler, b, 20, "b1")]
    for _, delivered in batches:
        assert delivered.all.wait(20.0)
    assert run.most_at_once["a"] == 2, run.most_at_once
    assert run.most_at_once["b"] == 3, run.most_at_once
    assert run.total_at_once == 4
    # The last slices end just after their results are delivered: then every count is back.
    wait_until(lambda: (a.running, b.running, a.queued, b.queued) == (0, 0, 0, 0))
    assert not a.batches and not b.batches


def test_a_small_batch_takes_one_worker_not_all(make: Callable[..., Scheduler]) -> None:
    """A tenant with one queued item gets one worker even when its cap allows more: another
    worker is started only for items the running ones will not get to."""
    run = Recorder()
    scheduler = make(run, 4)
    tenant = Tenant("t", 4)
    gate = threading.Event()
    run.gate["t-0"] = gate
    run.started["t-0"] = started = threading.Event()
    _, delivered = submit(scheduler, tenant, 1)
    assert started.wait(10.0)
    assert tenant.running == 1 and not tenant.ready
    gate.set()
    assert delivered.all.wait(10.0)


def test_abandoning_a_batch_answers_its_untaken_items_and_frees_them(
    make: Callable[..., Scheduler],
) -> None:
    """The only worker is held by the tenant's first batch; its second batch is abandoned (its
    caller went away): every item is answered ``unavailable`` at once, each admission is
    released once, and the tenant's next batch runs as if the abandoned one never was."""
    run = Recorder()
    scheduler = make(run, 1)
    tenant = Tenant("t", 1)
    gate = threading.Event()
    run.gate["held-0"] = gate
    run.started["held-0"] = started = threading.Event()
    _, held = submit(scheduler, tenant, 1, "held")
    assert started.wait(10.0)
    batch, abandoned = submit(scheduler, tenant, 10, "gone")
    scheduler.abandon(batch, True)
    assert abandoned.all.is_set()
    assert {r.error.code for r in abandoned.responses.values()} == {UNAVAILABLE}
    assert tenant.released == 10 and tenant.queued == 1  # the held item, not yet counted
    assert batch not in tenant.batches
    gate.set()
    assert held.all.wait(10.0)
    _, after = submit(scheduler, tenant, 5, "after")
    assert after.all.wait(10.0)
    assert all(r.value for r in after.responses.values())
    assert ("t", "gone-0") not in run.finished  # never run
    wait_until(lambda: tenant.running == 0)
    assert tenant.queued == 0 and tenant.released == 16


def test_a_cancelled_drain_gives_its_untaken_items_back() -> None:
    """``drain`` on the event loop: cancelling the awaiting caller answers the items no worker
    took ``unavailable`` and releases them; the tenant's next drain completes normally."""
    run = Recorder()
    scheduler = Scheduler(run, 1)
    tenant = Tenant("t", 1)
    gate = threading.Event()
    run.gate["t-0"] = gate
    run.started["t-0"] = started = threading.Event()
    results: dict[str, pb.EvaluateResponse] = {}

    def deliver(work: Work, response: pb.EvaluateResponse) -> None:
        results[work.request_id] = response

    async def scenario() -> None:
        task = asyncio.create_task(scheduler.drain(items(tenant, 8), deliver))
        for _ in range(10_000):
            if started.is_set():
                break
            await asyncio.sleep(0.001)
        assert started.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        answered = {key for key, value in results.items() if value.error.code == UNAVAILABLE}
        assert answered == {f"t-{i}" for i in range(1, 8)}  # all but the running one
        gate.set()
        again: list[str] = []
        await scheduler.drain(items(tenant, 3, "again"), lambda w, _r: again.append(w.request_id))
        assert sorted(again) == ["again-0", "again-1", "again-2"]

    try:
        asyncio.run(scenario())
        wait_until(lambda: "t-0" in results)  # the running item still finished and answered
        assert results["t-0"].value == "t:t-0"
        # The worker counts what it took once its slice ends, just after the last delivery.
        wait_until(lambda: (tenant.running, tenant.queued) == (0, 0))
        assert tenant.released == 11
    finally:
        gate.set()
        scheduler.close_scheduler()
        scheduler.pool.shutdown(wait=True)


def test_closing_runs_what_is_queued_and_refuses_new_batches() -> None:
    """After ``close_scheduler`` the workers still finish every queued item (the daemon drains
    on shutdown); a batch enqueued afterwards is not added, and ``abandon`` answers it."""
    run = Recorder({"a": 0.001, "b": 0.001})
    scheduler = Scheduler(run, 2)
    a, b = Tenant("a", 1), Tenant("b", 1)
    queued = [submit(scheduler, a, 30), submit(scheduler, b, 30)]
    scheduler.close_scheduler()
    late = Delivered(4)
    batch = Batch(None, items(a, 4, "late"), late)
    assert scheduler.enqueue(batch) == (False, False)
    scheduler.abandon(batch, False)
    assert late.all.is_set()
    assert {r.error.code for r in late.responses.values()} == {UNAVAILABLE}
    scheduler.pool.shutdown(wait=True)
    for _, delivered in queued:
        assert delivered.all.is_set()
        assert all(r.value and not r.HasField("error") for r in delivered.responses.values())
    assert a.released == 34 and b.released == 30
    assert (a.queued, b.queued, a.running, b.running) == (0, 0, 0, 0)


def test_real_wasm_evaluations_through_the_scheduler(make: Callable[..., Scheduler]) -> None:
    """The daemon's shape with a real ``WasmHost``: two tenants' calc spans on two workers,
    each answered with its own value, in its own tenant's instance pool."""
    with WasmHost() as host:
        module = host.load(wasm_path("calc").read_bytes())
        calc = Evaluator(name="calc", owner="standard", module=module)

        def run(work: Work) -> pb.EvaluateResponse:
            outcome = host.evaluate(
                work.evaluator.module, work.data, work.limits, pool_key=work.tenant.name
            )
            work.tenant.release()
            assert outcome.value is not None, outcome
            return pb.EvaluateResponse(id=work.request_id, value=outcome.value)

        scheduler = make(run, 2)
        results: dict[str, dict[str, str]] = {}
        waits = []
        for name, base in (("alpha", 100), ("beta", 200)):
            tenant = Tenant(name, 1)
            queue = collections.deque(
                Work(i, f"{name}-{i}", calc, f"{base} + {i}".encode(), Limits(), tenant)
                for i in range(50)
            )
            got: dict[str, str] = {}
            results[name] = got
            done = threading.Event()

            def deliver(
                work: Work,
                response: pb.EvaluateResponse,
                got: dict[str, str] = got,
                done: threading.Event = done,
            ) -> None:
                got[work.request_id] = response.value
                if len(got) == 50:
                    done.set()

            assert scheduler.enqueue(Batch(None, queue, deliver)) == (True, True)
            waits.append(done)
        for done in waits:
            assert done.wait(30.0)
        scheduler.close_scheduler()
        scheduler.pool.shutdown(wait=True)
    assert results["alpha"] == {f"alpha-{i}": str(100 + i) for i in range(50)}
    assert results["beta"] == {f"beta-{i}": str(200 + i) for i in range(50)}
