"""The GPU check judges the adapter, not the model: its span check against a real evald, and
its pass rule (no failed or aborted request, every closed span with evald's own value)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon_harness import start_daemon
from sglang_harness import CONFIG, TOKEN

from evald_lab.gpu_check import adapter_passed, check_spans


def _mode(errors: list[Any] | None = None, aborted: int = 0) -> dict[str, Any]:
    return {"errors": errors or [], "aborted": aborted}


def test_check_spans_compares_each_closed_span_with_evald(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, CONFIG)
    try:
        checks = check_spans(
            [
                "The expression is <calc>17 * 23 + 91</calc><result>482</result> items.",
                "<calc>9 / 0</calc><result_error>division_by_zero</result_error> and "
                "<calc>2 + 2</calc><result>5</result>",
                "The expression is <calc>1 + 1 + 1 + 1 + 1",  # never closed: not judged
                "no span at all",
            ],
            daemon.target,
            TOKEN,
        )
    finally:
        daemon.stop()
    assert checks["closed"] == 3
    assert checks["right"] == 2
    assert checks["wrong"] == [{"content": "2 + 2", "forced": "5", "expected": "4"}]


def test_pass_depends_on_what_the_adapter_controls() -> None:
    good = {"closed": 3, "right": 3, "wrong": []}
    modes = {"no-grammar": _mode(), "grammar-eval": _mode()}
    smoke = {"records": [{"text": "a"}, {"text": "b"}]}
    # A model that closes few spans still passes: the span rate is reported, not judged.
    assert adapter_passed(modes, smoke, good)
    assert not adapter_passed(modes, smoke, {"closed": 3, "right": 2, "wrong": []})
    assert not adapter_passed(modes, smoke, {"closed": 0, "right": 0, "wrong": []})
    assert not adapter_passed({**modes, "grammar-eval": _mode(aborted=1)}, smoke, good)
    assert not adapter_passed({**modes, "no-grammar": _mode(errors=[{"e": 1}])}, smoke, good)
    assert not adapter_passed(modes, {"records": [{"error": "HTTPError 500"}]}, good)
