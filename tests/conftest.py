"""The fixtures the whole suite shares, each made once per session wherever it is used.

The real evald daemon (``daemon``, with a tenant per concern: ``daemon_harness.session_config``)
serves the evald and lab tests; the real SmolLM2-135M-Instruct model (``llama_backend``,
``hf_backend``, ``smollm2_tokenizer``) serves the engine and lab tests. Loading the model takes
under a second on llama.cpp and a few seconds on transformers once the GGUF has been converted
and cached; tests that use it are marked ``model``.

The harness module of ``tests/evald`` (``daemon_harness``: the session config, its tenants and
their tokens, over the product's :mod:`evald.testing`) is put on ``sys.path``, so test modules
anywhere import it by name whatever the pytest import mode.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "evald"))

from daemon_harness import Daemon, free_port, session_config, start_daemon

#: Small enough to keep the KV cache cheap, large enough for every test prompt.
TEST_N_CTX = 2048


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
