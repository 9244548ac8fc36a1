"""Fixtures for the SGLang adapter tests: a real evald daemon, SGLang's real grammar backend.

``daemon_harness`` (tests/evald) starts the daemon; ``sglang_harness`` (next to this file) plays
SGLang's decode loop. Both folders are put on ``sys.path`` so test modules import them by name.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "evald"))

from daemon_harness import Daemon, start_daemon  # noqa: E402
from sglang_harness import CONFIG, TOKEN, environment  # noqa: E402


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
    from engine_adapter._server_runtime import close_shared_clients

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
