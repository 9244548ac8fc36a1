"""``[server] cpus``: evald runs on the CPUs it is given and nowhere else, so an engine bound to
the others never shares a core with tenants' work (issue 47, docs/operations.md).

Against real daemons: what the kernel says each thread of the daemon, and of its compile worker,
may run on (``/proc/PID/task/TID/status``, ``Cpus_allowed_list``) after real evaluations and a
real registration; an embedded daemon pins its own threads and leaves its host process's alone;
a CPU the daemon is not given, an empty list or a count instead of a list is refused with a
message that names the key and the CPU.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import EVALD, module, start_daemon, tenant_block

from evald.cli import EXIT_ERROR
from evald.client import Client
from evald.daemon import (
    ConfigError,
    EvaldServer,
    format_cpu_list,
    parse_config,
    parse_cpu_list,
)
from evald.testing import free_port, process_descendants

AVAILABLE = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(
    len(AVAILABLE) < 2, reason="pinning shows only where the test may use two CPUs or more"
)


def _allowed(pid: int) -> dict[int, str]:
    """``Cpus_allowed_list`` of every thread of ``pid``, by thread id."""
    found: dict[int, str] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(task.name)] = line.split(":", 1)[1].strip()
    return found


def _config(cpus: str | None, metrics_port: int | None = None) -> str:
    lines = ["[server]", "shutdown_grace_s = 2"]
    if cpus is not None:
        lines.append(f'cpus = "{cpus}"')
    if metrics_port is not None:
        lines.append(f'metrics_listen = "127.0.0.1:{metrics_port}"')
    lines.append(tenant_block("local", token=False, evaluators=["*"], allow_register=True))
    return "\n".join(lines) + "\n"


# The setting ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus", "written"),
    [("1", {1}, "1"), ("2-3,6", {2, 3, 6}, "2-3,6"), (" 0 , 2-2 ,1", {0, 1, 2}, "0-2")],
)
def test_cpu_lists_read_and_write_as_linux_does(text: str, cpus: set[int], written: str) -> None:
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == written


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('","', "expected a Linux CPU list"),
        ('"3-1"', "runs backwards"),
        ('"one"', "expected a Linux CPU list"),
        ('"1,,2"', "expected a Linux CPU list"),
        ("2", "which CPUs, not how many"),
    ],
)
def test_a_bad_cpu_list_is_refused_naming_the_key(value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"[server]\ncpus = {value}\n", "evald.toml")
    assert "evald.toml: server.cpus:" in str(caught.value)
    assert expected in str(caught.value)


def test_workers_default_to_one_per_configured_cpu() -> None:
    assert parse_config('[server]\ncpus = "2-3,6"\n').server.resolved_threads == 3
    assert parse_config('[server]\ncpus = "1"\nthreads = 2\n').server.resolved_threads == 2
    assert parse_config("").server.cpus == frozenset()
    assert parse_config('[server]\ncpus = ""\n').server.cpus == frozenset()  # empty: unset


# A real daemon --------------------------------------------------------------------------------


@needs_two
def test_every_thread_of_the_daemon_and_its_compile_worker_runs_on_the_configured_cpu(
    tmp_path: Path,
) -> None:
    cpu = str(AVAILABLE[-1])
    port = free_port()
    daemon = start_daemon(tmp_path, _config(cpu, port), metrics_port=port, own_session=True)
    try:
        client = daemon.client()
        client.register(module("echo", "pinned_echo"))  # the compile worker starts for it
        for _ in range(20):  # every worker thread has run an evaluation
            assert client.evaluate("pinned_echo", b"x").value == "x"
        threads = _allowed(daemon.pid)
        workers = {
            pid: _allowed(pid)
            for pid, command in process_descendants(daemon.pid).items()
            if "python" in command or "evald" in command
        }
        serving = next(line for line in daemon.log_lines() if line.get("msg") == "serving")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
    finally:
        assert daemon.stop() == 0
    assert len(threads) > 3, threads  # the event loop, gRPC's, workers, control, modules
    assert set(threads.values()) == {cpu}, threads
    assert workers, "no compile worker process was found"
    for pid, allowed in workers.items():
        assert set(allowed.values()) == {cpu}, (pid, allowed)
    assert serving["cpus"] == cpu and serving["threads"] == 1, serving
    assert f'evald_cpus{{cpus="{cpu}"}} 1.0' in metrics


@needs_two
def test_without_the_setting_the_daemon_keeps_every_cpu_it_is_given(tmp_path: Path) -> None:
    everything = format_cpu_list(AVAILABLE)
    daemon = start_daemon(tmp_path, _config(None))
    try:
        assert daemon.client().evaluate("calc", "1 + 1").value == "2"
        threads = _allowed(daemon.pid)
        serving = next(line for line in daemon.log_lines() if line.get("msg") == "serving")
    finally:
        daemon.stop()
    assert set(threads.values()) == {everything}, threads
    assert serving["cpus"] == everything


def _refused(tmp_path: Path, config: str, *args: str, prefix: tuple[str, ...] = ()) -> str:
    """Starts ``evald serve`` expecting it to refuse; returns its stderr."""
    path = tmp_path / "evald.toml"
    path.write_text(config)
    started = subprocess.run(
        [*prefix, EVALD, "serve", "--config", str(path), "--listen",
         f"unix:{tmp_path / 'evald.sock'}", "--state-dir", str(tmp_path / "state"), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert started.returncode == EXIT_ERROR, (started.returncode, started.stderr)
    assert not (tmp_path / "evald.sock").exists()
    return started.stderr


def test_a_cpu_the_daemon_is_not_given_is_refused_at_start(tmp_path: Path) -> None:
    missing = AVAILABLE[-1] + 1
    stderr = _refused(tmp_path, _config(f"{AVAILABLE[0]},{missing}"))
    assert f"server.cpus: CPU {missing} is not available to the daemon" in stderr, stderr
    assert f"it may run on {format_cpu_list(AVAILABLE)}" in stderr, stderr


@needs_two
def test_a_cpu_outside_the_daemons_taskset_is_refused_at_start(tmp_path: Path) -> None:
    given, other = AVAILABLE[0], AVAILABLE[-1]
    stderr = _refused(tmp_path, _config(str(other)), prefix=("taskset", "-c", str(given)))
    assert f"CPU {other} is not available to the daemon: it may run on {given}" in stderr


def test_the_command_line_list_is_checked_too(tmp_path: Path) -> None:
    stderr = _refused(tmp_path, _config(None), "--cpus", "0-")
    assert "error: invalid_argument: --cpus: expected a Linux CPU list" in stderr, stderr


# An embedded daemon ---------------------------------------------------------------------------


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[EvaldServer, str]]:
    """An :class:`EvaldServer` on its own event loop thread, pinned to the last CPU."""
    socket = tmp_path / "evald.sock"
    config = parse_config(
        f'[server]\ncpus = "{AVAILABLE[-1]}"\nthreads = 2\nlisten = "unix:{socket}"\n'
        f'state_dir = "{tmp_path / "state"}"\nshutdown_grace_s = 1\n'
        + tenant_block("local", token=False, evaluators=["*"])
    )
    server = EvaldServer(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="embedding-loop", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=60)
    try:
        yield server, f"unix:{socket}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@needs_two
def test_an_embedded_daemon_pins_its_own_threads_and_not_its_hosts(
    embedded: tuple[EvaldServer, str],
) -> None:
    _, target = embedded
    before = os.sched_getaffinity(0)
    with Client(target) as client:
        for _ in range(20):
            assert client.evaluate("calc", "6 * 7").value == "42"
    pinned = {
        thread.name: os.sched_getaffinity(thread.native_id or 0)
        for thread in threading.enumerate()
        if thread.name.startswith(("evald-guest", "evald-control", "evald-modules"))
    }
    loop_thread = next(t for t in threading.enumerate() if t.name == "embedding-loop")
    assert any(name.startswith("evald-guest") for name in pinned), pinned
    assert any(name.startswith("evald-control") for name in pinned), pinned
    assert all(cpus == {AVAILABLE[-1]} for cpus in pinned.values()), pinned
    assert os.sched_getaffinity(0) == before == set(AVAILABLE)
    assert os.sched_getaffinity(loop_thread.native_id or 0) == set(AVAILABLE)
