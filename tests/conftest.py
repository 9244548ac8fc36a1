"""The fixtures the whole suite shares, each made once per session wherever it is used.

The real evald daemon (``daemon``, with a tenant per concern: ``daemon_harness.session_config``)
serves the evald and lab tests; the real SmolLM2-135M-Instruct model (``llama_backend``,
``hf_backend``, ``smollm2_tokenizer``) serves the engine and lab tests. Loading the model takes
under a second on llama.cpp and a few seconds on transformers once the GGUF has been converted
and cached; tests that use it are marked ``model``.

The harness module of ``tests/evald`` (``daemon_harness``: the session config, its tenants and
their tokens, over the product's :mod:`evald.testing`) is put on ``sys.path``, so test modules
anywhere import it by name whatever the pytest import mode; so is ``toolchains`` (the Rust and
AssemblyScript compilers the SDK tests build with; the repository's asc becomes ``$EVALD_ASC``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "evald"))

from daemon_harness import Daemon, free_port, session_config, start_daemon
from toolchains import use_repository_asc

use_repository_asc()

#: Small enough to keep the KV cache cheap, large enough for every test prompt.
TEST_N_CTX = 2048
#: How long the suite's leftover processes get to end on their own at the end of the session.
ORPHANS_GONE_WITHIN_S = 15.0


@pytest.fixture(scope="session", autouse=True)
def no_orphans() -> Iterator[None]:
    """The suite's daemons leave no process behind, whatever the tests did to them.

    The test process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process whose
    parent dies — a daemon's compile worker after the daemon's ``kill -9`` — is re-parented
    here instead of to init, where it could no longer be told from other programs'. At the end
    of the session every such process must have ended; one that has not fails the session (and
    is killed).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    reaping = libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0
    yield
    if not reaping:
        return
    from multiprocessing import resource_tracker

    from evald.testing import process_alive, process_descendants

    own_tracker = getattr(resource_tracker._resource_tracker, "_pid", None)  # ends with us
    give_up = time.monotonic() + ORPHANS_GONE_WITHIN_S
    left = {pid: cmd for pid, cmd in process_descendants(os.getpid()).items() if pid != own_tracker}
    while left and time.monotonic() < give_up:
        time.sleep(0.2)
        left = {pid: cmd for pid, cmd in left.items() if process_alive(pid)}
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes the suite started outlived it: {left}"


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the session, with a tenant per concern (see ``session_config``)."""
    port = free_port()
    handle = start_daemon(
        tmp_path_factory.mktemp("daemon"), session_config(port), metrics_port=port
    )
    try:
        yield handle
    finally:
        status = handle.stop()
        assert status == 0, handle.log_path.read_text()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """One real PostgreSQL server for the session (the fleet store's tests), from the machine's
    binaries; the tests that use it skip, saying why, where PostgreSQL is not installed."""
    from evald.testing import postgres_bindir, start_postgres

    if postgres_bindir() is None:
        pytest.skip(
            "PostgreSQL is not installed: the fleet store's tests need its server binaries "
            "(Debian: apt-get install postgresql; or set EVALD_PG_BINDIR)"
        )
    from fleet_harness import logins

    server = start_postgres()
    try:
        logins(server)
        yield server
    finally:
        server.close()


@pytest.fixture
def fleet(postgres: Any, tmp_path: Path) -> Iterator[Any]:
    """A fresh fleet store database on the session's PostgreSQL; its daemons are stopped and
    the database dropped at the end."""
    from fleet_harness import Fleet

    handle = Fleet(postgres, tmp_path)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from engine_adapter.local import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def llama_backend() -> Iterator[Any]:
    """SmolLM2 on llama.cpp, shared by the session: tests must not assume an empty cache."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the llama extra)")
    from engine_adapter.local import load_backend

    backend = load_backend("llama", n_ctx=TEST_N_CTX)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def hf_backend() -> Iterator[Any]:
    """SmolLM2 on transformers (one torch thread: the test machine's cores are shared)."""
    from engine_adapter.local import load_backend

    backend = load_backend("hf", n_ctx=TEST_N_CTX, n_threads=1)
    yield backend
    backend.close()
