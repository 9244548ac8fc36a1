"""Heavy tenants yield the CPU (evald.daemon._priority): the workers running a heavy tenant's
items are lowered, and get their priority back at the item's end or its deadline.

Priorities are read from the kernel (/proc/PID/task/TID/stat), both for threads of this
process and for the workers of a real daemon; the tests say nothing about speed (the fuzz's
noisy-neighbour measurement does).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_harness import Daemon, module, outcome, start_daemon

from evald.client import Client
from evald.contract import pb
from evald.daemon import ConfigError, parse_config
from evald.daemon._cpu_group import SHARED_SESSION as _SHARED_SESSION
from evald.daemon._cpu_group import _parse as _parse_autogroup
from evald.daemon._cpu_group import group_reason
from evald.daemon._priority import HEAVY_RUN_S, Priorities, can_restore_priority
from evald.daemon._scheduler import Batch, Scheduler, TenantQueue, Work
from evald.testing import tenant_table

NICE = 19
ATTACKER_TOKEN = "priority-attacker-token-0123"
VICTIM_TOKEN = "priority-victim-token-0123"
LOOP_DEADLINE_MS = 600


def _nice(pid: int, tid: int) -> int:
    """The nice value of one thread, as the kernel reports it (field 19 of its stat line)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def _threads(pid: int, prefix: str) -> dict[int, int]:
    """Nice value per thread of ``pid`` whose name starts with ``prefix`` (every thread: "")."""
    found: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().startswith(prefix):
                found[int(task.name)] = _nice(pid, int(task.name))
        except (OSError, ValueError):
            continue  # the thread ended while we looked
    return found


def _base() -> int:
    """The nice value of the calling thread (on Linux, PRIO_PROCESS 0 is the calling thread):
    call it from the test's own thread, whose value the threads it starts inherit."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def _on_thread(function: object) -> object:
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(function()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return result[0]


def test_hold_lowers_the_calling_thread_and_release_restores_it() -> None:
    priorities = Priorities(NICE)
    pid = os.getpid()

    def held() -> tuple[int, int, int]:
        tid = threading.get_native_id()
        priorities.hold(time.monotonic() + 60)
        during = _nice(pid, tid)
        priorities.hold(time.monotonic() + 60)  # the next item: still lowered, once
        count = priorities.lowered()
        priorities.release()
        return during, count, _nice(pid, tid)

    try:
        assert _on_thread(held) == (NICE, 1, _base())
        assert priorities.lowered() == 0
    finally:
        priorities.close()


def test_a_worker_started_niced_gets_its_own_nice_value_back() -> None:
    """A daemon an operator started at nice 5 keeps nice 5 outside heavy items: restoring
    never raises a worker above the priority it had."""
    priorities = Priorities(NICE)
    pid = os.getpid()

    base = _base()

    def niced() -> tuple[int, int]:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, base + 5)
        priorities.hold(time.monotonic() + 60)
        during = _nice(pid, tid)
        priorities.release()
        return during, _nice(pid, tid)

    try:
        assert _on_thread(niced) == (NICE, base + 5)
    finally:
        priorities.close()


def test_the_watchdog_restores_a_worker_at_its_items_deadline() -> None:
    priorities = Priorities(NICE)
    pid = os.getpid()

    base = _base()

    def past_the_deadline() -> tuple[int, int]:
        tid = threading.get_native_id()
        priorities.hold(time.monotonic() + 0.05)
        lowered = _nice(pid, tid)
        give_up = time.monotonic() + 10
        while _nice(pid, tid) != base and time.monotonic() < give_up:
            sum(range(10_000))  # a guest still running past its deadline
        restored = _nice(pid, tid)
        priorities.release()  # the item ends: nothing more to restore
        return lowered, restored

    try:
        assert _on_thread(past_the_deadline) == (NICE, base)
        assert priorities.lowered() == 0
    finally:
        priorities.close()


_WITHOUT_PERMISSION = """
import ctypes, resource
# RLIMIT_NICE 0 (nothing below nice 20), and no CAP_SYS_NICE (capset: this thread and the
# threads it starts): what an unprivileged daemon without LimitNICE has.
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]
libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()
assert libc.capget(ctypes.byref(header), data) == 0
for field in ("effective", "permitted"):
    setattr(data[0], field, getattr(data[0], field) & ~(1 << 23))  # CAP_SYS_NICE
assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
from evald.daemon._priority import can_restore_priority
print(can_restore_priority(19))
"""


def test_the_probe_says_why_without_permission_to_restore() -> None:
    assert can_restore_priority(NICE) == ""  # the test suite may (root or RLIMIT_NICE)
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PERMISSION],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "RLIMIT_NICE" in result.stdout and "LimitNICE=+0" in result.stdout, result.stdout


def _work(tenant: TenantQueue, index: int) -> Work:
    from evald.host import Limits

    return Work(index, f"r{index}", None, b"", Limits(deadline_ms=1000), tenant)  # type: ignore[arg-type]


def test_the_scheduler_marks_a_tenant_heavy_by_the_cpu_its_items_use() -> None:
    """A tenant whose item uses more than HEAVY_RUN_S of CPU is heavy, and its next items run on
    a lowered worker; a tenant of quick items is never lowered."""
    import collections

    from evald.contract import pb
    from evald.daemon._scheduler import Batch

    pid = os.getpid()
    seen: dict[str, list[int]] = {"heavy": [], "light": []}

    def run(work: Work) -> pb.EvaluateResponse:
        seen[work.tenant.name].append(_nice(pid, threading.get_native_id()))
        if work.tenant.name == "heavy":
            began = time.thread_time()
            while time.thread_time() - began < HEAVY_RUN_S * 3:
                pass
        return pb.EvaluateResponse(id=work.request_id)

    priorities = Priorities(NICE)
    scheduler = Scheduler(run, 1, priorities=priorities)
    heavy, light = TenantQueue("heavy", 1), TenantQueue("light", 1)
    try:
        for tenant in (heavy, light, heavy, light):
            done = threading.Event()
            items = collections.deque([_work(tenant, 0), _work(tenant, 1)])
            remaining = [2]

            def deliver(
                _work: Work,
                _response: pb.EvaluateResponse,
                remaining: list[int] = remaining,
                done: threading.Event = done,
            ) -> None:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

            scheduler.enqueue(Batch(None, items, deliver))
            assert done.wait(30)
        assert heavy.heavy_until > time.monotonic() and light.heavy_until == 0.0
        # The first heavy item ran at normal priority (nothing was known yet), every later one
        # lowered; the light tenant's items, on the same worker between them, never.
        base = _base()
        assert seen["heavy"] == [base, NICE, NICE, NICE], seen
        assert seen["light"] == [base] * 4, seen
        assert priorities.lowered() == 0
    finally:
        scheduler.pool.shutdown(wait=True)
        priorities.close()


def test_cpu_spent_re_making_what_another_tenant_pushed_out_is_not_charged() -> None:
    """One tenant's cache churn made another heavy (a niced worker in 38 % of its samples): the
    victim's items paid for re-making the instances the churn had pushed out. The scheduler
    leaves out what the host reports as such (``WasmHost.take_uncharged_s``); the tenant's own
    CPU still counts."""
    import collections

    from evald.contract import pb
    from evald.daemon._scheduler import Batch

    burned = threading.local()

    def run(work: Work) -> pb.EvaluateResponse:
        began = time.thread_time()
        while time.thread_time() - began < HEAVY_RUN_S * 3:
            pass
        # the victim's CPU was all re-instantiation another tenant caused; the other's its own
        burned.uncharged = time.thread_time() - began if work.tenant.name == "victim" else 0.0
        return pb.EvaluateResponse(id=work.request_id)

    def uncharged() -> float:
        value: float = getattr(burned, "uncharged", 0.0)
        burned.uncharged = 0.0
        return value

    scheduler = Scheduler(run, 1, uncharged=uncharged)
    victim, own = TenantQueue("victim", 1), TenantQueue("own", 1)
    try:
        for tenant in (victim, own):
            done = threading.Event()
            scheduler.enqueue(
                Batch(None, collections.deque([_work(tenant, 0)]), lambda *_, done=done: done.set())
            )
            assert done.wait(30)
        assert victim.heavy_until == 0.0
        assert own.heavy_until > 0.0
    finally:
        scheduler.pool.shutdown(wait=True)


def _run_one(scheduler: Scheduler, tenant: TenantQueue, index: int = 0) -> None:
    import collections

    done = threading.Event()
    scheduler.enqueue(Batch(None, collections.deque([_work(tenant, index)]), lambda *_: done.set()))
    assert done.wait(60)


def test_a_long_call_is_lowered_while_it_runs_even_its_tenants_first() -> None:
    """A tenant's first long call after a quiet period (nothing marks it heavy yet) is lowered
    by the watchdog once it has used HEAVY_RUN_S of CPU, not only its next calls, and gets its
    priority back when it ends: the whole of a first 3 s spin at normal priority froze the
    engine sharing the machine."""
    pid = os.getpid()
    seen: list[tuple[int, int]] = []

    def run(work: Work) -> pb.EvaluateResponse:
        tid = threading.get_native_id()
        at_start = _nice(pid, tid)
        give_up = time.monotonic() + 30
        while _nice(pid, tid) != NICE and time.monotonic() < give_up:
            sum(range(1_000))  # a guest burning its CPU
        seen.append((at_start, _nice(pid, tid)))
        return pb.EvaluateResponse(id=work.request_id)

    priorities = Priorities(NICE)
    scheduler = Scheduler(run, 1, priorities=priorities)
    tenant = TenantQueue("spinner", 1)
    try:
        base = _base()
        _run_one(scheduler, tenant)
        assert seen == [(base, NICE)]
        assert priorities.lowered_in_flight() == 1
        assert priorities.lowered() == 0  # restored at the call's end
        assert tenant.heavy_until > time.monotonic()  # and the tenant is heavy now
    finally:
        scheduler.pool.shutdown(wait=True)
        priorities.close()


def test_light_calls_are_never_lowered_and_the_watchdog_goes_idle() -> None:
    """Quick calls never reach HEAVY_RUN_S: none is lowered, and once calls stop the watchdog
    sleeps until the next one wakes it (it reads no clock while the daemon is idle)."""
    pid = os.getpid()
    nices: list[int] = []

    def run(work: Work) -> pb.EvaluateResponse:
        nices.append(_nice(pid, threading.get_native_id()))
        return pb.EvaluateResponse(id=work.request_id)

    priorities = Priorities(NICE)
    scheduler = Scheduler(run, 2, priorities=priorities)
    tenant = TenantQueue("light", 2)
    try:
        for index in range(200):
            _run_one(scheduler, tenant, index)
        give_up = time.monotonic() + 30
        while not priorities.idle and time.monotonic() < give_up:
            time.sleep(0.01)
        assert priorities.idle
        _run_one(scheduler, tenant, 200)  # wakes it
        assert not priorities.idle
        assert set(nices) == {_base()} and len(nices) == 201
        assert priorities.lowered_in_flight() == 0 and tenant.heavy_until == 0.0
    finally:
        scheduler.pool.shutdown(wait=True)
        priorities.close()


def test_the_watchdog_restores_a_call_it_lowered_at_the_calls_deadline() -> None:
    """A call lowered in flight gets its priority back at its deadline (so it runs to notice
    its epoch deadline), and is not lowered again for the rest of that call."""
    pid = os.getpid()
    seen: list[int] = []

    def run(work: Work) -> pb.EvaluateResponse:
        tid = threading.get_native_id()
        for wanted in (NICE, _base()):
            give_up = time.monotonic() + 30
            while _nice(pid, tid) != wanted and time.monotonic() < give_up:
                sum(range(1_000))
            seen.append(_nice(pid, tid))
        spin_until = time.thread_time() + HEAVY_RUN_S * 4  # long past the threshold again
        while time.thread_time() < spin_until:
            pass
        seen.append(_nice(pid, tid))
        return pb.EvaluateResponse(id=work.request_id)

    from evald.host import Limits

    priorities = Priorities(NICE)
    scheduler = Scheduler(run, 1, priorities=priorities)
    tenant = TenantQueue("spinner", 1)
    try:
        import collections

        done = threading.Event()
        work = Work(0, "r0", None, b"", Limits(deadline_ms=200), tenant)  # type: ignore[arg-type]
        scheduler.enqueue(Batch(None, collections.deque([work]), lambda *_: done.set()))
        assert done.wait(60)
        assert seen == [NICE, _base(), _base()]
        assert priorities.lowered_in_flight() == 1 and priorities.lowered() == 0
    finally:
        scheduler.pool.shutdown(wait=True)
        priorities.close()


def _config(nice: int) -> str:
    return "\n".join(
        [
            f"[server]\nthreads = 2\nheavy_tenant_nice = {nice}",
            tenant_table(
                "attacker",
                token=ATTACKER_TOKEN,
                allow_register=True,
                limits={"fuel": 0, "deadline_ms": LOOP_DEADLINE_MS},
            ),
            tenant_table("victim", token=VICTIM_TOKEN, evaluators=["calc"]),
        ]
    )


@pytest.mark.parametrize("nice", [NICE, 0])
def test_a_daemon_lowers_the_worker_of_a_looping_tenant(tmp_path: Path, nice: int) -> None:
    """Against a real daemon: a tenant's infinite loop, its first call included, runs on a
    worker at ``heavy_tenant_nice`` (0: none is ever lowered), and so does the next one (the
    tenant is heavy by then); the victim's calls still answer, and every worker is back at the
    daemon's nice value once the loops ended."""
    daemon: Daemon = start_daemon(tmp_path, _config(nice))
    attacker = Client(daemon.target, ATTACKER_TOKEN, timeout_s=60)
    victim = Client(daemon.target, VICTIM_TOKEN, timeout_s=60)
    try:
        attacker.register(module("loop", "spin"))
        for _first_then_heavy in range(2):
            lowest = 0
            with ThreadPoolExecutor(1) as sender:
                call = sender.submit(attacker.evaluate, "spin", b"")
                while not call.done():
                    lowest = max(lowest, *_threads(daemon.pid, "").values())
                    assert victim.evaluate("calc", b"17 * 23 + 91").value == "482"
                    time.sleep(0.01)
                assert outcome(call.result()) == "deadline_exceeded"
            assert lowest == max(nice, _base())
        assert set(_threads(daemon.pid, "").values()) == {_base()}
        assert "keep their CPU priority" not in daemon.log_path.read_text()
    finally:
        attacker.close()
        victim.close()
        assert daemon.stop() == 0, daemon.log_path.read_text()


def test_heavy_tenant_nice_config() -> None:
    assert parse_config("").server.heavy_tenant_nice == NICE
    assert parse_config("[server]\nheavy_tenant_nice = 0\n").server.heavy_tenant_nice == 0
    for bad in ("-1", "20", '"19"', "true"):
        with pytest.raises(ConfigError, match=r"heavy_tenant_nice"):
            parse_config(f"[server]\nheavy_tenant_nice = {bad}\n")


def _autogroup_nice(pid: int) -> int:
    """The nice value of the scheduling group (autogroup) that process ``pid`` is in: 0 for
    the root group, whose file the kernel leaves empty (a test run from init's session, as
    CI's is) and whose weight nobody may change."""
    text = Path(f"/proc/{pid}/autogroup").read_text()
    return int(text.split()[-1]) if text.strip() else 0


#: Autogroups decide here unless the kernel has none or a CPU cgroup decides instead (the
#: reason this test process, which leads no session of its own, would be given otherwise).
needs_autogroups = pytest.mark.skipif(
    group_reason() not in ("", _SHARED_SESSION),
    reason=f"evald's group cannot be its own here: {group_reason()}",
)


def test_the_root_group_is_told_apart_from_an_autogroup() -> None:
    """The kernel leaves /proc/<pid>/autogroup empty for a process in the root group (init's
    session, a container's PID 1), whose weight cannot be changed: evald must not take it for
    a group of its own."""
    assert _parse_autogroup("/autogroup-260 nice 19\n") == 19
    assert _parse_autogroup("/autogroup-7 nice -3\n") == -3
    assert _parse_autogroup("") is None
    assert _parse_autogroup("garbage\n") is None


@needs_autogroups
def test_a_daemon_in_its_own_session_lowers_its_group_while_heavy_work_runs(
    tmp_path: Path,
) -> None:
    """docs/design.md, "Heavy work yields the CPU": nice orders threads only inside their
    scheduling group, so a daemon leading its own session (as a service does) lowers its
    session's autogroup while a worker is lowered, and gives it back after."""
    daemon: Daemon = start_daemon(tmp_path, _config(NICE), own_session=True)
    attacker = Client(daemon.target, ATTACKER_TOKEN, timeout_s=60)
    try:
        assert _autogroup_nice(daemon.pid) == 0
        attacker.register(module("loop", "spin"))
        seen = set()
        with ThreadPoolExecutor(1) as sender:
            call = sender.submit(attacker.evaluate, "spin", b"")
            while not call.done():
                seen.add(_autogroup_nice(daemon.pid))
                time.sleep(0.01)
            assert outcome(call.result()) == "deadline_exceeded"
        assert NICE in seen
        give_up = time.monotonic() + 30
        while _autogroup_nice(daemon.pid) != 0 and time.monotonic() < give_up:
            time.sleep(0.02)
        assert _autogroup_nice(daemon.pid) == 0
        assert _autogroup_nice(os.getpid()) == 0  # the test's own group was never touched
        assert "not its own to lower" not in daemon.log_path.read_text()
    finally:
        attacker.close()
        assert daemon.stop() == 0, daemon.log_path.read_text()


#: Run in a session of its own: two heavy calls 30 ms apart, then the group's history and how
#: long after the first call's end the second began (as its worker recorded it).
_BACK_TO_BACK = """
import threading, time
from evald.daemon._cpu_group import AutogroupPriority, group_reason
from evald.daemon._priority import Priorities
assert group_reason() == "", group_reason()
group = AutogroupPriority(19)
priorities = Priorities(19, group)
seen = {}
def calls():
    worker = priorities.worker()
    for call in range(2):
        worker.begin(time.thread_time(), time.monotonic() + 30, time.monotonic())
        if call == 1:
            seen["began"] = worker.began_at
        began = time.thread_time()
        while time.thread_time() - began < 0.15:
            pass
        if call == 0:
            seen["ended"] = time.monotonic()
        worker.end()
        time.sleep(0.03)
thread = threading.Thread(target=calls)
thread.start()
thread.join()
give_up = time.monotonic() + 30
while group.lowered and time.monotonic() < give_up:
    time.sleep(0.01)
priorities.close()
after = seen["began"] - seen["ended"]
print(group.changes, group.lowered, open("/proc/self/autogroup").read().split()[-1], after)
"""


@needs_autogroups
def test_the_group_stays_lowered_between_back_to_back_heavy_calls() -> None:
    """The kernel changes a group's nice value at most every 100 ms: a group given back in
    the 30 ms between two heavy calls would run the second at full weight until it may be
    lowered again. When the second call begins within the group's 0.2 s hold after the first
    one's end (always on a quiet machine), the group is lowered once and given back once, after
    the last call, however late the watchdog looks; a call that a loaded machine starts only
    after the hold may find the group given back (lowered again once it is heavy)."""
    run = subprocess.run(
        [sys.executable, "-c", _BACK_TO_BACK],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    changes, lowered, nice, after = run.stdout.split()
    assert (lowered, nice) == ("False", "0")
    assert changes == "2" if float(after) < 0.2 else changes in ("2", "4"), run.stdout


@needs_autogroups
def test_a_daemon_sharing_its_session_leaves_the_group_alone(tmp_path: Path) -> None:
    """Started as a child in this test's session, the daemon would lower the test's group as
    well: it says why it does not, and lowers only its workers."""
    daemon: Daemon = start_daemon(tmp_path, _config(NICE))
    attacker = Client(daemon.target, ATTACKER_TOKEN, timeout_s=60)
    try:
        attacker.register(module("loop", "spin"))
        seen = set()
        with ThreadPoolExecutor(1) as sender:
            call = sender.submit(attacker.evaluate, "spin", b"")
            while not call.done():
                seen.add(_autogroup_nice(daemon.pid))
                time.sleep(0.01)
        assert seen == {0}
        log = daemon.log_path.read_text()
        assert "not its own to lower" in log and "shares its session" in log
    finally:
        attacker.close()
        assert daemon.stop() == 0, daemon.log_path.read_text()
