"""How the adapter reads a request: spans from the structural tag, tenant from ``extra_args``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter import build_structural_tag, standard_evaluators
from engine_adapter.serving._request_options import allowed_targets
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.vllm._options import request_options

CONFIG = AdapterConfig(target="unix:/run/evald/evald.sock", token="server-token")
ALLOWED = allowed_targets(CONFIG, {"EVALD_ALLOWED_TARGETS": " 10.0.0.5:7000 , ,unix:/other.sock"})


def params(tag: Any, **extra: Any) -> SimpleNamespace:
    text = tag if isinstance(tag, str) or tag is None else json.dumps(tag)
    return SimpleNamespace(
        structured_outputs=SimpleNamespace(structural_tag=text), extra_args=extra or None
    )


@pytest.fixture(scope="module")
def tag() -> dict[str, Any]:
    grammar = build_structural_tag(standard_evaluators(["calc", "strop"]), "grammar-eval")
    assert grammar.structural_tag is not None
    return grammar.structural_tag


def test_allowed_targets() -> None:
    assert ALLOWED == {"unix:/run/evald/evald.sock", "10.0.0.5:7000", "unix:/other.sock"}


def test_spans_and_server_defaults(tag: dict[str, Any]) -> None:
    options = request_options(params(tag), CONFIG, ALLOWED)
    assert options is not None and options.refusal is None
    assert [(b.evaluator, b.begin, b.end) for b in options.bindings] == [
        ("calc", "<calc>", "</calc>"),
        ("strop", "<strop>", "</strop>"),
    ]
    assert (options.config.target, options.config.token) == (CONFIG.target, "server-token")


def test_request_tenant_target_and_renamed_evaluators(tag: dict[str, Any]) -> None:
    options = request_options(
        params(tag, evald_token="t0k", evald_target="10.0.0.5:7000",
               evald_evaluators="calc=calc-v2, strop = strings"),
        CONFIG,
        ALLOWED,
    )  # fmt: skip
    assert options is not None and options.refusal is None
    assert (options.config.target, options.config.token) == ("10.0.0.5:7000", "t0k")
    assert [b.evaluator for b in options.bindings] == ["calc-v2", "strings"]


@pytest.mark.parametrize(
    "token", ["", "  ", "\t", " t0k ", "t0k\n", "to ken", "t\x00k", "t\x7fk", "tök", "x" * 5000]
)
def test_a_named_token_that_cannot_be_one_is_refused_never_read_as_none(
    tag: dict[str, Any], token: str
) -> None:
    """An empty, blank or malformed token is permission_denied in band, with no token sent and
    a message that does not repeat it; only a request naming no token is the server's tenant."""
    options = request_options(params(tag, evald_token=token), CONFIG, ALLOWED)
    assert options is not None and options.refusal is not None
    assert options.refusal[0] == "permission_denied"
    assert options.config.token is None
    if token.strip():
        assert token.strip() not in options.refusal[1]


def test_the_server_token_goes_to_the_server_address_only(tag: dict[str, Any]) -> None:
    own = request_options(params(tag, evald_target=CONFIG.target), CONFIG, ALLOWED)
    assert own is not None and own.config.token == "server-token"
    other = request_options(params(tag, evald_target="10.0.0.5:7000"), CONFIG, ALLOWED)
    assert other is not None and other.refusal is None
    assert (other.config.target, other.config.token) == ("10.0.0.5:7000", None)


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"evald_target": "169.254.169.254:80"}, "permission_denied"),
        ({"evald_target": 7}, "permission_denied"),
        ({"evald_token": 12}, "permission_denied"),
        ({"evald_token": None}, "permission_denied"),
        ({"evald_evaluators": "calc:calc"}, "invalid_argument"),
    ],
)
def test_bad_options_are_refused_in_band(
    tag: dict[str, Any], extra: dict[str, Any], code: str
) -> None:
    options = request_options(params(tag, **extra), CONFIG, ALLOWED)
    assert options is not None and options.refusal is not None
    assert options.refusal[0] == code
    assert options.config.target == CONFIG.target  # never the refused address


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "not json",
        json.dumps({"structures": [], "triggers": []}),
        json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}),
    ],
)
def test_requests_without_evaluated_spans_are_not_followed(raw: str | None) -> None:
    assert request_options(params(raw), CONFIG, ALLOWED) is None
    assert request_options(SimpleNamespace(structured_outputs=None), CONFIG, ALLOWED) is None


def test_request_helper_round_trip(tmp_path: Any) -> None:
    """What ``evaluated_request`` sends is what the server side reads (a real evald answers
    ``ListEvaluators``), for the standard tag and for a tag with ``evaluated_tag`` elements."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "evald"))
    from daemon_harness import start_daemon

    from engine_adapter.testing.vllm import CONFIG as DAEMON_CONFIG
    from engine_adapter.testing.vllm import TOKEN
    from engine_adapter.vllm import evaluated_request

    daemon = start_daemon(tmp_path, DAEMON_CONFIG)
    try:
        standard = evaluated_request(daemon.target, TOKEN, ["calc", "units"], send_target=True)
        own_tag = {
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
        own = evaluated_request(daemon.target, TOKEN, tag=own_tag)
        question = "A hall has 38 rows of 27 chairs and 61 more. How many chairs?"
        narrowed = evaluated_request(daemon.target, TOKEN, ["calc"], operands_from=question)
        own_narrowed = evaluated_request(
            daemon.target, TOKEN, tag=own_tag, operands_from=question
        )
        off = evaluated_request(daemon.target, TOKEN, ["calc"], operands_from="no numbers")
    finally:
        daemon.stop()
    # operands from the context: narrowed where the question has numbers, off with a reason
    assert standard.operands is None and own.operands is None
    for request in (narrowed, own_narrowed):
        assert request.operands is not None and request.operands.applied
        assert dict(request.operands.evaluators[0].literals) == {"number": ("38", "27", "61")}
        assert '\\"38\\" | \\"27\\" | \\"61\\"' in json.dumps(request.structural_tag)
    assert off.operands is not None and not off.operands.applied
    assert "calc: the text holds no literal" in off.operands.reason
    plain = build_structural_tag(standard_evaluators(["calc"]), "grammar-eval")
    assert off.structural_tag == plain.structural_tag
    # Instructions for exactly the chosen evaluators, opt-in: the body never carries them.
    assert "<calc>" in standard.instructions and "<units>" in standard.instructions
    assert "<strop>" not in standard.instructions
    assert "instructions" not in json.dumps(standard.extra_body())
    messages = standard.with_instructions([{"role": "user", "content": "How far is 3 km in mi?"}])
    assert messages[0] == {"role": "system", "content": standard.instructions}
    assert messages[1]["role"] == "user" and len(messages) == 2
    config = AdapterConfig(target=daemon.target)
    for request, begins in (
        (standard, ["<calc>", "<units>"]),
        (own, ["<calc>"]),
        (narrowed, ["<calc>"]),
        (own_narrowed, ["<calc>"]),
    ):
        body = request.extra_body(max_tokens=8)
        assert body["max_tokens"] == 8
        sampling = SimpleNamespace(
            structured_outputs=SimpleNamespace(**body["structured_outputs"]),
            extra_args=body["vllm_xargs"],
        )
        options = request_options(sampling, config, allowed_targets(config, {}))
        assert options is not None and options.refusal is None
        assert [b.begin for b in options.bindings] == begins
        assert options.config.token == TOKEN
    assert standard.extra_args["evald_target"] == daemon.target
    assert "evaluated_tag" not in json.dumps(own.structural_tag)
