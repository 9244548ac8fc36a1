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

    from engine_adapter._server_runtime import AdapterRuntime

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
