"""Fixtures for the lab's tests (fuzz, bench, study, demo, GPU check).

They drive the same real daemon and model as the product's tests, from the suite's shared
fixtures (``tests/conftest.py``: ``daemon``, ``llama_backend``, ``smollm2_tokenizer``).
``sglang_harness`` (tests/engine_adapter/sglang) is put on ``sys.path`` so test modules import
it by name.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine_adapter" / "sglang"))
