"""No code forks a process that may hold gRPC (design.md §7, "A process that holds gRPC never
forks").

``Popen`` (and ``run``, ``call``, ``check_call``, ``check_output``) forks when it is given
``preexec_fn``, ``user``, ``group`` or ``extra_groups``; those starts go through
``evald.daemon.child_start``, whose ``preexec_fn`` is None wherever util-linux is installed.
``os.fork`` runs only where a test needs a fork's own semantics, in an interpreter it started.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("evald", "engine_adapter", "lab/evald_lab", "tools", "tests")
STARTS = {"Popen", "run", "call", "check_call", "check_output"}
FORKING = {"preexec_fn", "user", "group", "extra_groups"}
#: Where ``os.fork`` may appear, and why.
FORKS_ALLOWED = {
    # the memory reset's fork semantics, run in a new interpreter that holds no gRPC
    "tests/evald/host/test_memory_reset.py",
}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _findings(source: str, relative: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, relative)):
        if not isinstance(node, ast.Call):
            continue
        where = f"{relative}:{node.lineno}"
        name = _name(node.func)
        if name == "fork" and _name(getattr(node.func, "value", node.func)) == "os":
            if relative not in FORKS_ALLOWED:
                found.append(f"{where}: os.fork()")
        if name not in STARTS:
            continue
        for keyword in node.keywords:
            if keyword.arg not in FORKING:
                continue
            value = keyword.value
            if isinstance(value, ast.Constant) and value.value is None:
                continue
            if keyword.arg == "preexec_fn" and _name(value) == "preexec_fn":
                continue  # a ChildStart's: None where util-linux is installed
            found.append(f"{where}: {name}({keyword.arg}=...) forks; use child_start")
    return found


def test_no_start_forks() -> None:
    found = [
        finding
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for finding in _findings(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_the_scan_sees_a_forking_start() -> None:
    """The scan itself: each forking form is found, the ChildStart form is not."""
    sample = (
        "import os, subprocess\n"
        "subprocess.Popen(['x'], preexec_fn=lambda: None)\n"
        "subprocess.run(['x'], user=1)\n"
        "subprocess.check_output(['x'], extra_groups=[])\n"
        "os.fork()\n"
        "subprocess.Popen(start.argv, preexec_fn=start.preexec_fn)\n"
        "subprocess.run(['x'], user=None)\n"
    )
    found = _findings(sample, "sample.py")
    assert [line.split(":")[1] for line in found] == ["2", "3", "4", "5"]
