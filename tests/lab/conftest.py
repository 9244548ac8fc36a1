"""Fixtures for the lab's tests (fuzz, bench, study, demo, GPU check).

The lab's tests drive the same real daemon and the same real model as the product's, so they
take those fixtures from their one home: ``daemon`` from ``tests/evald/conftest.py``,
``llama_backend`` and ``smollm2_tokenizer`` from ``tests/engine_adapter/conftest.py`` (loaded by
path, under names of their own). ``daemon_harness`` (tests/evald) and ``sglang_harness``
(tests/engine_adapter/sglang) are put on ``sys.path`` so test modules import them by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "engine_adapter" / "sglang"))
sys.path.insert(0, str(TESTS / "evald"))


def _conftest(package: str) -> ModuleType:
    """``tests/<package>/conftest.py``, imported as a module of its own."""
    name = f"_lab_{package}_conftest"
    spec = importlib.util.spec_from_file_location(name, TESTS / package / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_engine_adapter = _conftest("engine_adapter")
daemon = _conftest("evald").daemon
llama_backend = _engine_adapter.llama_backend
smollm2_tokenizer = _engine_adapter.smollm2_tokenizer
