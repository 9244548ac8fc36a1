"""A daemon started as a child dies with its parent, however the parent dies.

Each test runs a real parent process that starts a real daemon the way the product's tools do
(``start_daemon``: the test harness, ``evald fuzz``, ``evald bench``; ``running_daemon``: the
demo; the GPU check's process runner), kills that parent with SIGKILL (no clean-up code runs),
and checks that the daemon is gone soon after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evald.daemon import ParentLink, watch_parent

#: Generous: the daemon drains (nothing is in flight) and exits in well under a second.
GONE_WITHIN_S = 20.0


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = GONE_WITHIN_S) -> bool:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _run_parent(script: str, tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """Starts ``script`` as the parent; returns it and the child pid it prints."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    if not line.strip().isdigit():
        parent.kill()
        _, err = parent.communicate(timeout=30)
        pytest.fail(f"the parent did not start its child: {line!r}\n{err}")
    return parent, int(line)


def _kill_parent_and_check(parent: subprocess.Popen[str], child: int) -> None:
    try:
        assert _alive(child), "the child should be running while its parent lives"
        time.sleep(0.5)
        assert _alive(child), "the child must not stop while its parent lives"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert _wait_gone(child), f"child {child} outlived its parent killed by SIGKILL"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


START_DAEMON_PARENT = """
    import sys, time
    from pathlib import Path
    from evald_lab.harness import start_daemon
    root = Path(sys.argv[1])
    daemon = start_daemon(root, '[[tenants]]\\nname = "local"\\n')
    print(daemon.pid, flush=True)
    time.sleep(600)
"""


def test_start_daemon_child_dies_when_parent_is_killed(tmp_path: Path) -> None:
    parent, child = _run_parent(START_DAEMON_PARENT, tmp_path)
    _kill_parent_and_check(parent, child)


def test_start_daemon_from_a_thread_that_ends_keeps_the_daemon(tmp_path: Path) -> None:
    """The link belongs to the process, not the thread that started the daemon (the pitfall of
    ``PR_SET_PDEATHSIG``): the daemon outlives a finished starter thread, then dies with the
    parent."""
    script = """
        import sys, threading, time
        from pathlib import Path
        from evald_lab.harness import start_daemon
        root = Path(sys.argv[1])
        handles = []
        starter = threading.Thread(
            target=lambda: handles.append(start_daemon(root, '[[tenants]]\\nname = "local"\\n'))
        )
        starter.start(); starter.join()
        time.sleep(1.0)
        print(handles[0].pid, flush=True)
        time.sleep(600)
    """
    parent, child = _run_parent(script, tmp_path)
    _kill_parent_and_check(parent, child)


def test_demo_daemon_dies_when_parent_is_killed(tmp_path: Path) -> None:
    script = """
        import os, sys, time
        from pathlib import Path
        from rich.console import Console
        from evald_lab.demo import running_daemon
        def children():
            for entry in os.listdir("/proc"):
                try:
                    fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                if fields[1] == str(os.getpid()):
                    yield int(entry)
        with running_daemon(Path(sys.argv[1]), Console(file=open(os.devnull, "w"))):
            (pid,) = children()
            print(pid, flush=True)
            time.sleep(600)
    """
    parent, child = _run_parent(script, tmp_path)
    _kill_parent_and_check(parent, child)


def test_gpu_check_children_die_when_parent_is_killed(tmp_path: Path) -> None:
    """The GPU check's runner ties both kinds of child: ``evald serve`` through the pipe, any
    other program (the inference server) through the parent-death signal."""
    script = """
        import os, sys, time
        from pathlib import Path
        from evald_lab.gpu_check import _process
        root = Path(sys.argv[1])
        with _process(["sleep", "600"], root / "sleep.log", dict(os.environ)) as other:
            print(other.pid, flush=True)
            time.sleep(600)
    """
    parent, child = _run_parent(script, tmp_path)
    _kill_parent_and_check(parent, child)


def test_daemon_keeps_serving_while_the_link_is_open_and_stops_when_it_closes(
    tmp_path: Path,
) -> None:
    """Closing the write end (what the kernel does when the parent dies) stops the daemon
    cleanly, through the same drain as SIGTERM: exit status 0."""
    from evald_lab.harness import start_daemon

    daemon = start_daemon(tmp_path, '[[tenants]]\nname = "local"\n')
    try:
        assert daemon.parent_link is not None
        time.sleep(0.5)
        assert daemon.alive()
        daemon.parent_link.close()
        assert daemon.process.wait(timeout=GONE_WITHIN_S) == 0
        assert any(line.get("msg") == "stopped" for line in daemon.log_lines())
    finally:
        if daemon.alive():
            daemon.kill()


def test_watch_parent_refuses_a_closed_descriptor() -> None:
    link = ParentLink()
    (fd,) = link.pass_fds
    link.close()
    with pytest.raises(OSError):
        watch_parent(fd, grace_s=0.1)


def test_serve_with_a_bad_parent_fd_is_a_clear_error(tmp_path: Path) -> None:
    from evald_lab.harness import evald_command

    config = tmp_path / "evald.toml"
    config.write_text('[[tenants]]\nname = "local"\n')
    result = subprocess.run(
        [
            *evald_command(),
            "serve",
            "--config",
            str(config),
            "--listen",
            f"unix:{tmp_path / 's.sock'}",
            "--state-dir",
            str(tmp_path / "state"),
            "--parent-fd",
            "987",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert "error: invalid_argument: --parent-fd 987" in result.stderr
