"""The one engine-neutral request builder (``engine_adapter.serving._request_builder``): the
request options it writes, the lowering it does, and the engines' helpers that only wrap it
(their defaults come from the one home, ``DEFAULT_SPECIAL_EXCLUDES``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from engine_adapter import sglang, vllm
from engine_adapter.serving import (
    EXTRA_ARG_EVALUATORS,
    EXTRA_ARG_TARGET,
    EXTRA_ARG_TOKEN,
    lowered_tag,
    request_option_values,
    span_request,
)
from engine_adapter.spans import (
    DEFAULT_SPECIAL_EXCLUDES,
    build_structural_tag,
    find_lowered_spans,
    standard_evaluators,
)
from engine_adapter.vllm.request import lower_for_vllm


def test_request_options_name_the_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALD_TOKEN", "from-env")
    assert request_option_values() == {EXTRA_ARG_TOKEN: "from-env"}
    assert request_option_values("mine") == {EXTRA_ARG_TOKEN: "mine"}
    assert request_option_values("") == {}  # an empty token is the caller's: none is sent
    monkeypatch.delenv("EVALD_TOKEN")
    assert request_option_values() == {}
    # A target is sent whenever one is given, even empty (vLLM's send_target without one).
    assert request_option_values(None, "unix:/x") == {EXTRA_ARG_TARGET: "unix:/x"}
    assert request_option_values(None, "") == {EXTRA_ARG_TARGET: ""}
    renamed = [replace(spec, tag="math") for spec in standard_evaluators(["calc"])]
    renamed += standard_evaluators(["units"])
    assert request_option_values(None, None, renamed) == {EXTRA_ARG_EVALUATORS: "math=calc"}


def test_a_tag_without_evaluated_spans_is_sent_as_it_is() -> None:
    specs = standard_evaluators(["calc"])
    plain = build_structural_tag(specs, "grammar-eval").structural_tag
    assert plain is not None
    assert lowered_tag(plain, specs) == plain
    own = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Total: "},
                {"type": "evaluated_tag", "begin": "<calc>", "end": "</calc>",
                 "evaluator": "calc", "result": {"begin": "<result>", "end": "</result>"}},
            ],
        },
    }  # fmt: skip
    lowered = lowered_tag(own, specs)
    assert "evaluated_tag" not in str(lowered)
    assert [b.begin for b in find_lowered_spans(lowered, specs)] == ["<calc>"]
    assert lower_for_vllm(own, specs) == lowered


@pytest.mark.parametrize(
    "helper",
    [span_request, sglang.structural_tag_for, vllm.evaluated_request, lower_for_vllm, lowered_tag],
)
def test_every_request_helper_excludes_the_one_default_special_tokens(
    helper: Callable[..., Any],
) -> None:
    default = inspect.signature(helper).parameters["special_tokens"].default
    assert default is DEFAULT_SPECIAL_EXCLUDES
