"""A daemon started as a child dies with its parent, however the parent dies.

Each test runs a real parent process that starts a real daemon the way tools do
(:func:`evald.testing.start_daemon`: the tests, ``evald fuzz``, ``evald bench``), kills that
parent with SIGKILL (no clean-up code runs), and checks that the daemon is gone soon after. The
lab's own starters (the demo, the GPU check's runner) are checked in ``tests/lab``.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from parent_death import GONE_WITHIN_S, kill_parent_and_check, run_parent

from evald.daemon import ParentLink, watch_parent

START_DAEMON_PARENT = """
    import sys, time
    from pathlib import Path
    from evald.testing import start_daemon
    root = Path(sys.argv[1])
    daemon = start_daemon(root, '[[tenants]]\\nname = "local"\\n')
    print(daemon.pid, flush=True)
    time.sleep(600)
"""


def test_start_daemon_child_dies_when_parent_is_killed(tmp_path: Path) -> None:
    parent, child = run_parent(START_DAEMON_PARENT, tmp_path)
    kill_parent_and_check(parent, child)


def test_start_daemon_from_a_thread_that_ends_keeps_the_daemon(tmp_path: Path) -> None:
    """The link belongs to the process, not the thread that started the daemon (the pitfall of
    ``PR_SET_PDEATHSIG``): the daemon outlives a finished starter thread, then dies with the
    parent."""
    script = """
        import sys, threading, time
        from pathlib import Path
        from evald.testing import start_daemon
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
    parent, child = run_parent(script, tmp_path)
    kill_parent_and_check(parent, child)


def test_daemon_keeps_serving_while_the_link_is_open_and_stops_when_it_closes(
    tmp_path: Path,
) -> None:
    """Closing the write end (what the kernel does when the parent dies) stops the daemon
    cleanly, through the same drain as SIGTERM: exit status 0."""
    from evald.testing import start_daemon

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
    from evald.testing import evald_command

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
