"""What running SGLang and vLLM servers have in common, written once for both harnesses.

Each harness (:mod:`engine_adapter.testing.sglang`, :mod:`engine_adapter.testing.vllm`) starts
its engine its own way (command line, environment, how it stops); the rest is the same run:
the daemon config with the tenants both test (the server's own, a spinning one, a slow one),
the engine's venv found by environment variable or checkout folder, ``/health`` polled until the
server answers or dies, a stream's ``data:`` chunks, the Prometheus lines of ``/metrics``, a
process stopped by a signal and then killed, and the machine's CPUs split between the engine and
evald (:class:`CpuPartition`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evald.contract import token_sha256

__all__ = [
    "SLOW_TENANT_DEADLINE_MS",
    "SPAN_DEADLINE_MS",
    "SPIN_TENANT_DEADLINE_MS",
    "CpuPartition",
    "adapter_checkout",
    "daemon_config",
    "metric_lines",
    "rank_cpu_lists",
    "stop_process",
    "stream_chunks",
    "tenant",
    "venv_python",
    "wait_healthy",
]

#: The adapter's per-span deadline on the test servers (a hung evald costs a span this long).
SPAN_DEADLINE_MS = 3000
#: A tenant whose evaluators may run 10 s, so a spinning span lasts the adapter's whole deadline.
SPIN_TENANT_DEADLINE_MS = 10_000
#: The slow tenant's evaluators run at most this long: its spinning evaluator is a slow one
#: (each span holds one of evald's two workers this long, well inside the span deadline).
SLOW_TENANT_DEADLINE_MS = 400


def tenant(
    name: str, token: str, *, allow_register: bool = False, deadline_ms: int | None = None
) -> str:
    """One ``[[tenants]]`` entry of the test daemon's config: the token's hash, every
    evaluator; ``deadline_ms`` lifts the tenant's limits (fuel off) to that deadline."""
    lines = [
        "[[tenants]]",
        f'name = "{name}"',
        f'token_sha256 = "{token_sha256(token)}"',
        'evaluators = ["*"]',
    ]
    if allow_register:
        lines.append("allow_register = true")
    if deadline_ms is not None:
        lines += ["[tenants.limits]", f"deadline_ms = {deadline_ms}", "fuel = 0"]
    return "\n".join(lines)


def daemon_config(*tenants: str) -> str:
    """The test daemon's config: two workers, a short shutdown, the local tenant (no token)
    and ``tenants`` (:func:`tenant`)."""
    head = '[server]\nthreads = 2\nshutdown_grace_s = 2\n\n[[tenants]]\nname = "local"\n'
    head += 'evaluators = ["*"]'
    return "\n" + "\n\n".join([head, *tenants]) + "\n"


def adapter_checkout() -> str:
    """The folder this process imports the adapter from. A server puts it alone on its
    ``PYTHONPATH``, ahead of the copy its venv installed (editable, from the checkout that
    built the venv), so a server started from another checkout runs that checkout's adapter:
    the code under test."""
    import engine_adapter

    return str(Path(engine_adapter.__file__).resolve().parents[1])


@dataclass(frozen=True)
class CpuPartition:
    """The machine's CPUs split between an engine and evald, as an operator partitions them
    (docs/operations.md, "Partitioning the CPU"): the engine's server runs under ``taskset``
    on ``engine`` with its OpenMP threads bound there (``SGLANG_CPU_OMP_THREADS_BIND``,
    ``VLLM_CPU_OMP_THREADS_BIND``; unset, each binds them to a whole NUMA node, evald's cores
    included), and evald's ``[server] cpus`` is ``evald``. Both are Linux cpu-lists.
    """

    engine: str
    evald: str

    @classmethod
    def split(cls, evald_cpus: int = 1) -> CpuPartition:
        """The last ``evald_cpus`` of the CPUs this process may use for evald, the others for
        the engine (2 CPUs: the engine on CPU 0, evald on CPU 1).

        Raises:
            ValueError: fewer than ``evald_cpus + 1`` CPUs to split.
        """
        cpus = sorted(os.sched_getaffinity(0))
        if evald_cpus < 1 or len(cpus) <= evald_cpus:
            raise ValueError(
                f"cannot give evald {evald_cpus} of {len(cpus)} CPUs and the engine the rest"
            )
        return cls(_cpu_list(cpus[:-evald_cpus]), _cpu_list(cpus[-evald_cpus:]))

    def engine_prefix(self) -> list[str]:
        """The command that runs the engine's server (all its processes) on its CPUs."""
        return ["taskset", "-c", self.engine]

    def engine_env(self, bind_variable: str, ranks: int = 1) -> dict[str, str]:
        """The engine's environment: its OpenMP threads bound to its CPUs through
        ``bind_variable`` (where its CPU kernels bind them: SGLang only with AMX or on Arm),
        one OpenMP thread per CPU wherever they are not. With tensor-parallel ``ranks``, each
        rank gets its own share of the CPUs (:func:`rank_cpu_lists`), and the engine sets each
        rank's thread count from its list."""
        if ranks > 1:
            return {bind_variable: rank_cpu_lists(ranks, self.engine)}
        return {bind_variable: self.engine, "OMP_NUM_THREADS": str(_cpu_count(self.engine))}

    def daemon_config(self, config: str) -> str:
        """``config`` (a daemon config with a ``[server]`` table) with evald's CPUs set."""
        if "[server]\n" not in config:
            raise ValueError("the daemon config has no [server] table to set cpus in")
        return config.replace("[server]\n", f'[server]\ncpus = "{self.evald}"\n', 1)


def _cpu_list(cpus: list[int]) -> str:
    """A Linux cpu-list of single CPUs (``"0,1"``; taskset, evald and both engines read it)."""
    return ",".join(str(cpu) for cpu in cpus)


def _cpu_ids(cpu_list: str) -> list[int]:
    """The CPUs a Linux cpu-list names, in its order (``"0-2,16"``: 0, 1, 2, 16)."""
    cpus: list[int] = []
    for item in cpu_list.split(","):
        first, _, last = item.strip().partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _cpu_count(cpu_list: str) -> int:
    """How many CPUs a Linux cpu-list names (``"0-13,16"``: 15)."""
    return len(_cpu_ids(cpu_list))


def rank_cpu_lists(ranks: int, cpu_list: str | None = None) -> str:
    """The CPUs of ``cpu_list`` (default: those this process may use) split into ``ranks``
    runs of consecutive entries, as even as they divide, one cpu-list per tensor-parallel rank
    joined by ``|`` (2 CPUs, 2 ranks: ``"0|1"``): the form ``VLLM_CPU_OMP_THREADS_BIND`` and
    ``SGLANG_CPU_OMP_THREADS_BIND`` take for several ranks. Unset, vLLM binds each rank to a
    NUMA node of its own, and refuses to start with fewer nodes than ranks.

    Raises:
        ValueError: fewer CPUs than ranks (a rank would have none).
    """
    if cpu_list is None:
        cpu_list = _cpu_list(sorted(os.sched_getaffinity(0)))
    cpus = _cpu_ids(cpu_list)
    if ranks < 1 or len(cpus) < ranks:
        raise ValueError(f"cannot split the CPUs {cpu_list!r} between {ranks} ranks")
    share, extra = divmod(len(cpus), ranks)
    lists, start = [], 0
    for rank in range(ranks):
        end = start + share + (rank < extra)
        lists.append(_cpu_list(cpus[start:end]))
        start = end
    return "|".join(lists)


def venv_python(variable: str, venv: str, root: Path | None = None) -> Path | None:
    """``$variable``, else ``VENV/bin/python`` in the checkout ``root`` (default: the current
    folder), if present."""
    explicit = os.environ.get(variable)
    checkout = root if root is not None else Path.cwd()
    candidate = Path(explicit) if explicit else checkout / venv / "bin" / "python"
    return candidate if candidate.exists() else None


def wait_healthy(
    process: subprocess.Popen[bytes],
    url: str,
    engine: str,
    log: Callable[[], str],
    stop: Callable[[], None],
    timeout_s: float,
) -> None:
    """Polls ``url/health`` until it answers 200; a server that exits, or is not ready in
    ``timeout_s`` (then stopped), fails with the tail of its log."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if process.poll() is not None:
            raise RuntimeError(f"{engine} exited with {process.returncode}:\n{log()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(1.0)
    stop()
    raise RuntimeError(f"{engine} not ready in {timeout_s:.0f} s:\n{log()[-4000:]}")


def stream_chunks(
    url: str, payload: dict[str, Any], timeout_s: float
) -> Iterator[tuple[dict[str, Any], float]]:
    """``POST`` a streamed request; each ``data:`` chunk (``[DONE]`` left out) with the time it
    arrived (``time.monotonic()``)."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            yield json.loads(line[5:]), time.monotonic()


def metric_lines(url: str) -> Iterator[tuple[str, str]]:
    """``(name with labels, value)`` of every sample line of ``url/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            yield name, value


def stop_process(
    process: subprocess.Popen[bytes], sig: signal.Signals, wait_s: float, *, group: bool = False
) -> None:
    """``sig``, up to ``wait_s`` for the process to exit, then a kill; ``group`` also kills
    whatever is left of its process group (an engine's worker processes)."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    if group:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
