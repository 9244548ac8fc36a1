"""A real SGLang CPU server and evald on CPUs apart (docs/operations.md, "Partitioning the CPU"):
every thread of every SGLang process runs on the engine's CPUs, every thread of evald on its
own, and a span still gets its value. What is checked is what the kernel says each thread may
run on (``/proc/PID/task/TID/status``), after real requests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import Daemon, start_daemon

from engine_adapter import list_evaluators
from engine_adapter.testing import CpuPartition, fixed_tag
from engine_adapter.testing import sglang as sglang_server
from evald.daemon import parse_cpu_list

pytestmark = [
    pytest.mark.sglang_server,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a partition needs 2 CPUs"),
]


def _allowed(pid: int) -> set[str]:
    """The distinct ``Cpus_allowed_list`` of the threads of ``pid``."""
    found: set[str] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        found.update(
            line.split(":", 1)[1].strip()
            for line in status.splitlines()
            if line.startswith("Cpus_allowed_list:")
        )
    return found


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (SGLang's launcher, scheduler, detokenizer)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[CpuPartition, Daemon, sglang_server.SglangServer]
]:  # fmt: skip
    python = sglang_server.sglang_python(Path(__file__).resolve().parents[3])
    if python is None:
        pytest.skip("the SGLang venv is absent (.venv-sglang; `make sglang-venv`)")
    root = tmp_path_factory.mktemp("sgl-partition")
    partition = CpuPartition.split()
    config = partition.daemon_config(sglang_server.CONFIG)
    daemon = start_daemon(root / "evald", config, own_session=True)
    try:
        env = {
            "EVALD_TARGET": daemon.target,
            "EVALD_TOKEN": sglang_server.TOKEN,
            "EVALD_DEADLINE_MS": str(sglang_server.DEADLINE_MS),
        }
        server = sglang_server.start_server(python, env, root / "sglang.log", partition=partition)
        try:
            yield partition, daemon, server
        finally:
            server.stop()
    finally:
        daemon.stop()


@pytest.mark.timeout(900)  # starts its own server (minutes on a loaded machine)
def test_the_engine_and_evald_run_on_cpus_apart(
    partitioned: tuple[CpuPartition, Daemon, sglang_server.SglangServer],
) -> None:
    partition, daemon, server = partitioned
    calc = {s.name: s for s in list_evaluators(daemon.target, sglang_server.TOKEN)}["calc"]
    tag = fixed_tag("So ", (calc.binding(), "6 * 7"), ".")
    answer = server.generate("Compute:", max_new_tokens=30, structural_tag=tag)
    assert "<result>42</result>" in answer["text"], answer["text"]
    engine = parse_cpu_list(partition.engine)
    processes = _group(server.process.pid)
    assert len(processes) >= 2, processes  # the launcher and its scheduler, at least
    for pid in processes:
        for allowed in _allowed(pid):
            assert parse_cpu_list(allowed) <= engine, (pid, allowed, partition)
    assert _allowed(daemon.pid) == {partition.evald}
