"""The lab's own daemon and server starters tie their children's lives to theirs: killing the
parent with SIGKILL takes the child along (the product's ``start_daemon`` is checked in
``tests/evald/daemon/test_parent_death.py``, with the same helpers)."""

from __future__ import annotations

from pathlib import Path

from parent_death import kill_parent_and_check, run_parent


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
    parent, child = run_parent(script, tmp_path)
    kill_parent_and_check(parent, child)


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
    parent, child = run_parent(script, tmp_path)
    kill_parent_and_check(parent, child)
