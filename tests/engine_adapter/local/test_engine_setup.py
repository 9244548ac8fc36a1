"""Choosing where ``grammar-eval`` spans are evaluated (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapter.local import EVALUATOR_MODES, EngineError, open_evaluator


def test_python_and_inprocess_offer_the_standard_evaluators() -> None:
    for kind in ("python", "inprocess"):
        setup = open_evaluator(kind, names=["calc", "strop"])
        try:
            assert [spec.name for spec in setup.evaluators] == ["calc", "strop"]
            assert setup.warning is None
            future = setup.evaluator.submit("calc", "17 * 23 + 91", 2000)
            assert future.result(timeout=30).value == "482"
        finally:
            setup.close()


def test_unknown_names_and_kinds_are_engine_errors() -> None:
    with pytest.raises(EngineError, match="nope not offered by python"):
        open_evaluator("python", names=["calc", "nope"])
    with pytest.raises(EngineError, match="unknown evaluator mode 'cloud'"):
        open_evaluator("cloud")
    assert EVALUATOR_MODES == ("evald", "inprocess", "python")


def test_unreachable_evald_degrades_to_unavailable_spans(tmp_path: Path) -> None:
    setup = open_evaluator(
        "evald", target=f"unix:{tmp_path / 'absent.sock'}", connect_timeout_s=0.5
    )
    try:
        assert setup.warning is not None and "evald serve" in setup.warning
        assert "calc" in {spec.name for spec in setup.evaluators}
        future = setup.evaluator.submit("calc", "1 + 1", 500)
        setup.evaluator.flush()
        assert future.result(timeout=5).error_code == "unavailable"
    finally:
        setup.close()
