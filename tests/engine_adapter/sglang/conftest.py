"""Fixtures for the SGLang adapter tests: a real evald daemon, SGLang's real grammar backend, and
real SGLang CPU servers.

``daemon_harness`` (tests/evald) starts the daemon; ``sglang_harness`` (next to this file) plays
SGLang's decode loop on SGLang's grammar layer; :mod:`engine_adapter.testing.sglang` starts the
real server from ``.venv-sglang`` (``make sglang-venv``), one per scheduler for the session (the
``sglang_server`` marker; ``make sglang-test``). The folders are put on ``sys.path`` so test
modules import the harnesses by name.
"""

from __future__ import annotations

import os
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
from sglang_harness import CONFIG, TOKEN, environment  # noqa: E402

from engine_adapter.testing import PLAIN_PROMPTS  # noqa: E402
from engine_adapter.testing import sglang as sglang_server  # noqa: E402

ROOT = HERE.parents[2]


def sglang_available() -> bool:
    try:
        import sglang.srt.constrained.xgrammar_backend
        import sglang.srt.plugins  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    handle = start_daemon(tmp_path_factory.mktemp("evald-sglang"), CONFIG)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def adapter_env(daemon: Daemon) -> dict[str, str]:
    """The environment an operator sets to enable the adapter against the test daemon."""
    return {"EVALD_TARGET": daemon.target, "EVALD_TOKEN": TOKEN, "EVALD_DEADLINE_MS": "5000"}


@pytest.fixture(scope="session")
def plugins_loaded(adapter_env: dict[str, str]) -> Iterator[None]:
    """SGLang's own ``load_plugins()`` in this process, with the adapter enabled."""
    if not sglang_available():
        pytest.skip("SGLang's grammar layer is not installed (pip install sglang==0.5.23)")
    from sglang.srt.plugins import load_plugins

    with environment(**adapter_env):
        load_plugins()
    yield
    from engine_adapter.serving._server_runtime import close_shared_clients

    close_shared_clients()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from engine_adapter.local import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def backend(plugins_loaded: None, adapter_env: dict[str, str], tokenizer: Any) -> Any:
    """SGLang's real ``XGrammarGrammarBackend`` as a scheduler builds it (hooks applied)."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    with environment(**adapter_env):
        return XGrammarGrammarBackend(
            tokenizer, vocab_size=len(tokenizer), model_eos_token_ids=[tokenizer.eos_token_id]
        )


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="session")
def sglang_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Unix socket paths are limited to 107 bytes: keep the folder short.
    return tmp_path_factory.mktemp("sgl")


@pytest.fixture(scope="session")
def server_daemon(sglang_root: Path) -> Iterator[Daemon]:
    """The evald the servers evaluate with (the harness's tenants, their tokens)."""
    handle = start_daemon(sglang_root / "evald", sglang_server.CONFIG, own_session=True)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def fault_socket(sglang_root: Path) -> Path:
    """Where the fault tests' own evald listens (allowed on the servers, started per test)."""
    return sglang_root / "fault" / "evald.sock"


@pytest.fixture
def fault_daemon(sglang_root: Path, fault_socket: Path) -> Iterator[Daemon]:
    """A fresh evald at :func:`fault_socket` for one test (stopped, or killed, by the test)."""
    fault_socket.unlink(missing_ok=True)
    handle = start_daemon(sglang_root / "fault", sglang_server.CONFIG, socket_path=fault_socket)
    try:
        yield handle
    finally:
        handle.stop()


#: The real servers the tests run against: each scheduler with one rank, then with two
#: tensor-parallel ranks (each rank's OpenMP threads on its own core).
SERVERS = [(scheduler, 1) for scheduler in sglang_server.SCHEDULERS] + [
    (scheduler, 2) for scheduler in sglang_server.SCHEDULERS
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Which real servers run which tests. The two-rank one with the overlap scheduler
    (SGLang's default) runs the whole suite but the tests marked ``one_rank``: what those check
    does not depend on the ranks (a benchmark's measurement runs, the CPU evald takes beside
    hogs), and on two ranks they would only repeat it, slower. The two-rank one with the normal
    scheduler runs the tests marked ``rank_agreement`` only: how the ranks agree on each span's
    outcome (values, deadlines, a stopped or killed evald, aborts while parked) is where the
    schedulers differ at two ranks; the rest would repeat the one-rank runs and the overlap
    server's, at the cost of CI minutes. Tests marked ``overlap_only`` run with the overlap
    scheduler only."""

    def server_of(item: pytest.Item) -> tuple[str, int] | None:
        callspec = getattr(item, "callspec", None)
        return None if callspec is None else callspec.params.get("server")

    def left_to_the_other_servers(item: pytest.Item) -> bool:
        server = server_of(item)
        if server is None:
            return False
        if server[0] != "overlap" and item.get_closest_marker("overlap_only"):
            return True
        if server[1] == 1:
            return False
        if item.get_closest_marker("one_rank"):
            return True
        return server[0] == "normal" and not item.get_closest_marker("rank_agreement")

    dropped = [item for item in items if left_to_the_other_servers(item)]
    if dropped:
        ids = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in ids]
        config.hook.pytest_deselected(items=dropped)


@pytest.fixture(
    scope="session",
    params=SERVERS,
    ids=[s if tp == 1 else f"{s}-tp{tp}" for s, tp in SERVERS],
)
def server(
    request: pytest.FixtureRequest, server_daemon: Daemon, fault_socket: Path, sglang_root: Path
) -> Iterator[sglang_server.SglangServer]:
    """A real SGLang server with the adapter, once per scheduler (``normal``, ``overlap``) and
    tensor-parallel size (1, 2)."""
    python = sglang_server.sglang_python(ROOT)
    if python is None:
        reason = sglang_server.unsupported_reason(ROOT)
        pytest.skip(
            f"SGLang cannot run on this CPU: {reason}"
            if reason
            else "the SGLang venv is absent (.venv-sglang; build it with `make sglang-venv`, or "
            "point EVALD_SGLANG_PYTHON at a Python with SGLang 0.5.23 and this repository)"
        )
    scheduler, tp_size = request.param
    name = scheduler if tp_size == 1 else f"{scheduler}-tp{tp_size}"
    env = {
        "EVALD_TARGET": server_daemon.target,
        "EVALD_TOKEN": sglang_server.TOKEN,
        "EVALD_DEADLINE_MS": str(sglang_server.DEADLINE_MS),
        "EVALD_ALLOWED_TARGETS": f"unix:{fault_socket}",
        "EVALD_SPAN_LOG": str(sglang_root / f"spans-{name}.jsonl"),
    }
    handle = sglang_server.start_server(
        python, env, sglang_root / f"sglang-{name}.log", scheduler=scheduler, tp_size=tp_size
    )
    try:
        yield handle
    finally:
        handle.stop()
        print(f"SGLang log ({name}): {handle.log_path}")


@pytest.fixture(scope="session")
def plugin_off_texts(sglang_root: Path) -> dict[str, str]:
    """What a server *without* the adapter writes for each plain prompt, alone (greedy, 24
    tokens): the reference that requests without spans must match on the adapter's servers.

    The server is started with no ``EVALD_*`` in its environment, so SGLang loads the plugin's
    entry point and the plugin stays inert, as for a user who has not enabled it."""
    python = sglang_server.sglang_python()
    if python is None:
        pytest.skip("the SGLang venv is absent (.venv-sglang; `make sglang-venv`)")
    with environment(**{key: None for key in os.environ if key.startswith("EVALD_")}):
        handle = sglang_server.start_server(python, {}, sglang_root / "sglang-plugin-off.log")
    try:
        return {
            prompt: handle.generate(prompt, max_new_tokens=24)["text"] for prompt in PLAIN_PROMPTS
        }
    finally:
        handle.stop()


@pytest.fixture
def span_log(server: sglang_server.SglangServer, sglang_root: Path) -> Path:
    return sglang_root / f"spans-{server.name}.jsonl"


@pytest.fixture(scope="session")
def server_specs(server_daemon: Daemon) -> dict[str, Any]:
    from engine_adapter import list_evaluators

    return {spec.name: spec for spec in list_evaluators(server_daemon.target, sglang_server.TOKEN)}
