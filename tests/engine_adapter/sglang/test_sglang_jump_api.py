"""What the scheduler side asks of ``EvaluatorGrammar`` (sit out, rejoin, take the region), on
SGLang's real grammar layer with a real daemon: the scheduler itself is tested in real servers
(``test_sglang_server.py``)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.constrained.xgrammar_backend",
    reason="SGLang's grammar layer is not installed (pip install --no-deps sglang==0.5.23)",
)

from daemon_harness import Daemon
from sglang_harness import TOKEN, expected_region

from engine_adapter.sglang import EvaluatorGrammar, structural_tag_for

pytestmark = pytest.mark.sglang


def feed(grammar: EvaluatorGrammar, text: str) -> None:
    """Accepts ``text`` token by token, as SGLang does with sampled tokens."""
    for token in grammar.runtime.codec.encode_continuation(text.encode()):
        grammar.accept_token(token)


def closed_span(backend: Any, daemon: Daemon, content: str) -> EvaluatorGrammar:
    tag = structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="So <calc>")
    grammar = backend.dispatch_structural_tag(json.dumps(tag))
    assert isinstance(grammar, EvaluatorGrammar)
    feed(grammar, f"So <calc>{content}</calc>")
    grammar.runtime.flush()
    return grammar


def wait_ready(grammar: EvaluatorGrammar) -> None:
    give_up = time.monotonic() + 10
    while not grammar.ready_to_rejoin and time.monotonic() < give_up:
        time.sleep(0.002)


def test_a_closed_span_wants_out_until_its_region_is_taken(backend: Any, daemon: Daemon) -> None:
    grammar = closed_span(backend, daemon, "17 * 23 + 91")
    assert grammar.wants_out
    wait_ready(grammar)
    assert grammar.ready_to_rejoin and grammar.wants_out
    codec = grammar.runtime.codec
    region = expected_region("calc", "17 * 23 + 91")
    tokens = grammar.take_region(room=100)
    assert codec.decode(tokens).decode() == region == "<result>482</result>"
    assert not grammar.wants_out and grammar.jumps == 1 and grammar.fault is None
    assert grammar.pending_future() is None
    # The wrapped matcher took the region as if sampled: free text follows (a refused token
    # would raise), and the span holds the daemon's value.
    feed(grammar, " items")
    assert [(s.content, s.value) for s in grammar.spans] == [("17 * 23 + 91", "482")]


def test_take_region_honours_the_room_left(backend: Any, daemon: Daemon) -> None:
    grammar = closed_span(backend, daemon, "1 / 0")
    wait_ready(grammar)
    first = grammar.take_region(room=3)
    assert len(first) == 3 and grammar.wants_out  # the rest is still to come
    rest = grammar.take_region(room=100)
    codec = grammar.runtime.codec
    assert codec.decode([*first, *rest]).decode() == "<result_error>division_by_zero</result_error>"
    assert grammar.take_region(room=100) == [] and not grammar.wants_out


def test_a_pending_span_is_not_ready_and_has_a_future(backend: Any, daemon: Daemon) -> None:
    """The value is pending (the daemon is stopped): the request must sit out, and the
    scheduler can sleep on the future; the deadline ends the wait with an error region."""
    import os
    import signal

    from engine_adapter.serving._server_runtime import AdapterRuntime

    base = backend._evald_runtime
    config = type(base.config)(**{**base.config.__dict__, "deadline_ms": 300})
    runtime = AdapterRuntime(config, base.codec)
    tag = structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="So <calc>")
    compiled = backend.dispatch_structural_tag(json.dumps(tag))
    grammar = EvaluatorGrammar(compiled.grammar.copy(), compiled.bindings, runtime)
    feed(grammar, "So <calc>2 + 2</calc>")  # the client connects on this first submission
    runtime.flush()
    wait_ready(grammar)
    assert grammar.take_region(room=100)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        feed(grammar, " and <calc>3 + 3</calc>")
        runtime.flush()
        assert grammar.wants_out and not grammar.ready_to_rejoin
        assert grammar.pending_future() is not None
        wait_ready(grammar)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    tokens = grammar.take_region(room=100)
    assert (
        grammar.runtime.codec.decode(tokens).decode()
        == "<result_error>deadline_exceeded</result_error>"
    )


def apart_grammar(backend: Any, daemon: Daemon, deadline_ms: int) -> EvaluatorGrammar:
    """A request whose result and error openers share no first character (``[`` / ``{``):
    nothing of its region can be forced before the value is known."""
    from engine_adapter.serving._server_runtime import AdapterRuntime

    base = backend._evald_runtime
    config = type(base.config)(**{**base.config.__dict__, "deadline_ms": deadline_ms})
    span = {
        "type": "evaluated_tag",
        "begin": "<calc>",
        "end": "</calc>",
        "evaluator": "calc",
        "result": {"begin": "[", "end": "]"},
        "error": {"begin": "{", "end": "}"},
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [{"type": "const_string", "value": "So "}, span, span],
        },
    }
    compiled = backend.dispatch_structural_tag(json.dumps(tag))
    assert isinstance(compiled, EvaluatorGrammar)
    return EvaluatorGrammar(
        compiled.grammar.copy(), compiled.bindings, AdapterRuntime(config, base.codec)
    )


def forced_in_row(grammar: EvaluatorGrammar) -> int:
    """Fills one mask row as SGLang does for a step the request is in; the one token left."""
    import torch

    mask = grammar.allocate_vocab_mask(grammar.runtime.codec.vocab_size, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    (word,) = torch.nonzero(mask[0] != 0).flatten().tolist()
    bits = int(mask[0][word]) & 0xFFFFFFFF
    assert bits & (bits - 1) == 0, "exactly one token is allowed"
    return int(word * 32 + bits.bit_length() - 1)


def test_a_step_built_before_the_span_closed_waits_only_its_budget(
    backend: Any, daemon: Daemon
) -> None:
    """SGLang's overlap scheduler launches a step before it reads the token that closes a
    span, so the request is in a step while its value is pending. With nothing of the region
    to force, the row waits what is left of the step's budget, then the span ends in band:
    evald stopped (SIGSTOP), a span deadline of a minute, and the step goes on at once."""
    import os
    import signal

    from engine_adapter.serving._step_wait import StepWaits

    grammar = apart_grammar(backend, daemon, deadline_ms=60_000)
    grammar.step_waits = StepWaits(budget_s=0.05)
    codec = grammar.runtime.codec
    feed(grammar, "So <calc>2 + 2</calc>")  # the client connects on this first submission
    grammar.runtime.flush()
    wait_ready(grammar)
    assert codec.decode(grammar.take_region(room=100)).decode() == "[4]"
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        feed(grammar, "<calc>3 + 3</calc>")
        grammar.step_waits.new_step()
        token = forced_in_row(grammar)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert codec.decode([token]) == b"{"
    late = grammar.spans[1]
    assert late.error_code == "deadline_exceeded" and late.result is not None
    assert "step budget of 50 ms" in late.result.message
    assert late.waited_s < 30.0, "the row did not wait for the span's deadline"
    assert (grammar.step_waits.waits, grammar.step_waits.gave_up) == (1, 1)
    grammar.accept_token(token)
    rest = grammar.take_region(room=100)
    assert codec.decode([token, *rest]).decode() == "{deadline_exceeded}"


def test_a_value_back_within_the_step_budget_is_forced(backend: Any, daemon: Daemon) -> None:
    from engine_adapter.serving._step_wait import StepWaits

    grammar = apart_grammar(backend, daemon, deadline_ms=60_000)
    grammar.step_waits = StepWaits(budget_s=30.0)  # the wait ends when the value lands
    feed(grammar, "So <calc>6 * 7</calc>")
    token = forced_in_row(grammar)
    codec = grammar.runtime.codec
    assert codec.decode([token]) == b"["
    assert grammar.spans[0].value == "42" and grammar.step_waits.gave_up == 0
