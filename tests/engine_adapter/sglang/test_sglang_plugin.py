"""The plugin as SGLang loads it: through the ``sglang.srt.plugins`` entry point, in a process
started with multiprocessing *spawn* (as SGLang starts its schedulers) that calls SGLang's own
``load_plugins()``. Switching the plugin off and refusing bad settings are checked in process."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.plugins",
    reason="SGLang's grammar layer is not installed (pip install --no-deps sglang==0.5.23)",
)

from daemon_harness import Daemon
from sglang_harness import child_enabled, environment, expected_region, spans_in

pytestmark = pytest.mark.sglang

CHILD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def child(adapter_env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """The report of a spawned process that loaded the plugin (``child_enabled``)."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    with environment(**adapter_env):  # the child inherits the environment at start
        process = spawn.Process(target=child_enabled, args=(results,), name="sglang-scheduler")
        process.start()
    try:
        try:
            report: dict[str, Any] = results.get(timeout=CHILD_TIMEOUT_S)
        except queue.Empty:
            report = {"error": f"no report from the child (exit code {process.exitcode})"}
        process.join(timeout=60)
        yield report
    finally:
        if process.is_alive():
            process.kill()


def test_hooks_are_installed_by_load_plugins_in_a_spawned_child(
    child: dict[str, Any],
) -> None:
    report = child
    assert "error" not in report, report.get("error")
    assert report["before_load"].startswith("evald SGLang adapter: hooks not installed on")
    assert "dispatch_structural_tag" in report["before_load"], "unpatched classes are detected"
    assert report["hooks"] and all(report["hooks"].values())
    # SGLang's grammar layer alone (this venv has no scheduler): the eight grammar and settings
    # hooks (dispatch_json among them, for computed JSON schemas; get_ready_grammar_requests,
    # for tensor-parallel ranks' refusals); the scheduler's four are checked in a real server
    # (test_sglang_server.py).
    assert report["scheduler_available"] is False
    assert len(report["hooks"]) == 8
    assert any(target.endswith(".dispatch_json") for target in report["hooks"])


def test_spawned_child_evaluates_a_span_through_the_daemon(
    child: dict[str, Any], daemon: Daemon
) -> None:
    report = child
    assert "error" not in report, report.get("error")
    assert report["grammar"] == "EvaluatorGrammar" and report["aborted"] is None
    assert spans_in(report["text"], "calc") == [("100 - 58", expected_region("calc", "100 - 58"))]


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("tp-inline", ["--tp-size 2", "EVALD_SGLANG_SCHEDULING=inline", "unset"]),
        ("spec", ["speculative decoding", "NGRAM", "start without --speculative-algorithm"]),
        ("backend", ["--grammar-backend llguidance", "xgrammar"]),
    ],
)
def test_unsupported_options_are_refused_before_resolution(
    child: dict[str, Any], name: str, words: list[str]
) -> None:
    message = child["refusals"][name]
    assert message.startswith("evald SGLang adapter (EVALD_TARGET is set) cannot run with")
    for word in words:
        assert word in message
    assert "Unset EVALD_TARGET" in message


def test_tensor_parallelism_is_accepted(child: dict[str, Any]) -> None:
    """``--tp-size 2`` with jump scheduling (the default): the ranks exchange span outcomes
    (``_rank_sync``); the real two-rank servers are in test_sglang_tensor_parallel.py."""
    # resolution goes on past the adapter's check (and may stop later for want of a model)
    assert "evald SGLang adapter" not in child["refusals"]["tp"]
    from types import SimpleNamespace

    from engine_adapter.sglang import plugin

    with environment(EVALD_SGLANG_SCHEDULING=None):
        plugin.check_server_args(SimpleNamespace(tp_size=8, pp_size=1))


def test_scheduler_refuses_pp_when_building_the_grammar_backend(
    child: dict[str, Any],
) -> None:
    assert "--pp-size 2" in child["scheduler_refusal"]


def test_without_a_target_the_plugin_registers_nothing() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from engine_adapter.sglang import plugin

    before = {target: len(hooks) for target, hooks in HookRegistry._hooks.items()}
    with environment(EVALD_TARGET=None):
        plugin.register()
    assert {target: len(hooks) for target, hooks in HookRegistry._hooks.items()} == before


def test_a_bad_setting_stops_the_process_with_its_name() -> None:
    from engine_adapter.sglang import plugin

    # load_plugins() logs and ignores an Exception from a plugin; SystemExit goes through.
    assert not issubclass(SystemExit, Exception)
    with environment(EVALD_TARGET="unix:/run/evald/evald.sock", EVALD_DEADLINE_MS="soon"):
        with pytest.raises(SystemExit, match="evald SGLang adapter: EVALD_DEADLINE_MS='soon'"):
            plugin.register()
