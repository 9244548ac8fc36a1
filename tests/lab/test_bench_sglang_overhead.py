"""``engine-adapter bench sglang-overhead`` runs (its numbers are measured, not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.constrained.xgrammar_backend", reason="SGLang's grammar layer is not installed"
)


def test_overhead_benchmark_runs_and_writes_its_report(tmp_path: Path) -> None:
    from evald_lab.bench.sglang_overhead import run

    result = run(rows=4, steps=12, out=tmp_path)
    saved = json.loads((tmp_path / "overhead.json").read_text())
    assert saved == result
    assert result["rows"] == 4 and result["steps"] == 12
    for key in ("bare_accept_us_p50", "wrapped_accept_us_p50", "adapter_us_per_token_p50"):
        assert result[key] > 0 or key.startswith("adapter")
    assert result["target_us"] == 2.0
    assert (tmp_path / "overhead.png").stat().st_size > 1000
