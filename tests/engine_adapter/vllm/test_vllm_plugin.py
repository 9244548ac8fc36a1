"""The plugin's installation into vLLM's real scheduler classes, and its start-up refusals."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter.testing.vllm import vllm_python
from engine_adapter.vllm.plugin import (
    UnsupportedConfiguration,
    check_config,
    log_forcing,
    max_drafts,
)
from engine_adapter.vllm.proposer import FORCED_ONLY, ForcedOnlyProposer, speculative_config

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = r"""
import json, os
from engine_adapter.vllm import plugin
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

out = {}
os.environ.pop("EVALD_TARGET", None)
plugin.register()
out["off"] = bool(getattr(Scheduler.schedule, "__evald_hook__", False))
os.environ["EVALD_TARGET"] = "unix:/nonexistent/evald.sock"
plugin.register()
plugin.register()
out["on"] = plugin.verify_installed(Scheduler)
out["async"] = plugin.verify_installed(AsyncScheduler)
out["wrapped_once"] = not getattr(Scheduler.schedule.__wrapped__, "__evald_hook__", False)

class Custom(Scheduler):
    def schedule(self, *args, **kwargs):
        return super().schedule(*args, **kwargs)

try:
    plugin.verify_installed(Custom)
    out["custom"] = "accepted"
except plugin.PluginError as exc:
    out["custom"] = str(exc)
from engine_adapter.serving._internals import missing_internals

out["internals"] = missing_internals(plugin._INTERNALS)
plugin._INTERNALS["vllm.v1.request.Request"] += ("renamed_field",)
try:
    plugin.install(Scheduler)
    out["renamed"] = "accepted"
except plugin.PluginError as exc:
    out["renamed"] = str(exc)
os.environ["EVALD_DEADLINE_MS"] = "soon"
try:
    plugin.register()
    out["bad"] = "accepted"
except plugin.PluginError as exc:
    out["bad"] = str(exc)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
def test_hooks_installed_on_vllms_scheduler() -> None:
    python = vllm_python(ROOT)
    if python is None:
        pytest.skip("the vLLM venv is absent (.venv-vllm; build it with `make vllm-venv`)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    hooks = {
        "__init__": True,
        "add_request": True,
        "schedule": True,
        "get_grammar_bitmask": True,
        "_free_request": True,
    }
    assert out["off"] is False  # nothing is touched without EVALD_TARGET
    assert out["on"] == hooks and out["async"] == hooks
    assert out["wrapped_once"] is True
    assert "Custom overrides schedule" in out["custom"]
    assert "EVALD_DEADLINE_MS='soon'" in out["bad"]
    assert out["internals"] == []  # every internal the adapter uses is in this vLLM
    assert "vllm.v1.request.Request.renamed_field" in out["renamed"]


def config(**changes: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "speculative_config": None,
        "scheduler_config": SimpleNamespace(async_scheduling=False),
        "parallel_config": SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2),
    }
    values.update(changes)
    return SimpleNamespace(**values)


def speculative(**fields: Any) -> SimpleNamespace:
    values: dict[str, Any] = {"rejection_sample_method": "standard", "parallel_drafting": False}
    values.update(fields)
    return SimpleNamespace(**values)


def test_supported_configuration_passes() -> None:
    check_config(config())  # tensor parallelism is fine: one scheduler serves every rank
    assert max_drafts(config()) == 0


@pytest.mark.parametrize(
    "spec",
    [
        speculative(method="ngram", model="ngram", num_speculative_tokens=4),
        speculative(method="custom_class", model=FORCED_ONLY, num_speculative_tokens=16),
    ],
)
def test_speculative_decoding_next_to_the_adapter(spec: SimpleNamespace) -> None:
    check_config(config(speculative_config=spec))
    assert max_drafts(config(speculative_config=spec)) == spec.num_speculative_tokens


def test_the_forced_only_proposer_drafts_nothing() -> None:
    proposer = ForcedOnlyProposer(object())
    proposer.load_model(object())
    assert proposer.propose([[1], [2, 3], []], None, None, slot_mappings=None) == [[], [], []]
    assert speculative_config(8) == {
        "method": "custom_class",
        "model": "engine_adapter.vllm.proposer.ForcedOnlyProposer",
        "num_speculative_tokens": 8,
    }
    with pytest.raises(ValueError, match="at least 1"):
        speculative_config(0)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"speculative_config": speculative(method="eagle3", model="m")}, "method eagle3"),
        ({"speculative_config": speculative(method="draft_model", model="m")}, "draft_model"),
        (
            {"speculative_config": speculative(method="custom_class", model="my.Proposer")},
            "custom_class \\(my.Proposer\\)",
        ),
        (
            {"speculative_config": speculative(method="ngram", rejection_sample_method="block")},
            "rejection_sample_method='block'",
        ),
        ({"speculative_config": speculative(method="ngram", parallel_drafting=True)}, "parallel"),
        ({"scheduler_config": SimpleNamespace(async_scheduling=True)}, "--no-async-scheduling"),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=2)}, "pipeline-parallel"),
    ],
)
def test_unsupported_configurations_are_refused(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=needle) as info:
        check_config(config(**changes))
    assert "Unset EVALD_TARGET" in str(info.value)


def test_async_scheduling_refusal_names_the_gpu_default_and_the_flag() -> None:
    """vLLM turns async scheduling on by default on GPUs: the refusal a GPU user meets first
    says so, and what to pass."""
    with pytest.raises(UnsupportedConfiguration) as info:
        check_config(config(scheduler_config=SimpleNamespace(async_scheduling=True)))
    message = str(info.value)
    assert "on by default on GPUs" in message
    assert "start vLLM with --no-async-scheduling" in message


@pytest.mark.parametrize(
    ("drafts", "greedy_only", "says", "never"),
    [
        (16, False, ["verify step, up to 17 forced tokens"], ["one forced token per step"]),
        (16, True, ["verify step, up to 17", "vllm-project/vllm#55005"], ["--speculative-config"]),
        (0, False, ["one forced token per step", "--speculative-config"], ["verify step"]),
    ],
)
def test_the_start_up_log_says_how_results_are_forced(
    caplog: pytest.LogCaptureFixture,
    drafts: int,
    greedy_only: bool,
    says: list[str],
    never: list[str],
) -> None:
    """A server with the adapter's proposer where the verify step works (a GPU) is told it
    forces through the verify step, never that it forces one token per step."""
    with caplog.at_level("INFO", logger="engine_adapter.vllm"):
        log_forcing(drafts, greedy_only)
    for needle in says:
        assert needle in caplog.text, caplog.text
    for needle in never:
        assert needle not in caplog.text, caplog.text
