"""Fixtures for the engine_adapter tests.

The local-engine tests load the real SmolLM2-135M-Instruct model: once per session per backend
(llama.cpp: under a second; transformers: a few seconds once the GGUF has been converted and
cached). They are marked ``model``. The evald daemon harness of ``tests/evald`` is importable
from here (``from daemon_harness import start_daemon``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evald"))

#: Small enough to keep the KV cache cheap, large enough for every test prompt.
TEST_N_CTX = 2048


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
