"""``EvaluatorGrammar`` inside SGLang's real grammar layer, driven as SGLang's scheduler drives it.

Everything is real except the model: SGLang 0.5.23's ``XGrammarGrammarBackend`` (hooks installed
by SGLang's own ``load_plugins()``), SmolLM2's tokenizer, ``SamplingBatchInfo`` building and
applying the batch's bitmask, the evald daemon over a unix socket, and its WASM evaluators. The
model is a script the sampler follows where the mask lets it (``sglang_harness``), so what a
span contains is known, while every value in the text comes from the daemon and is checked
against the evaluator's Python reference.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.constrained.xgrammar_backend",
    reason="SGLang's grammar layer is not installed (pip install --no-deps sglang==0.5.23)",
)

from daemon_harness import Daemon, start_daemon
from sglang_harness import (
    CONFIG,
    TOKEN,
    MiniScheduler,
    RandomModel,
    Row,
    ScriptedModel,
    expected_region,
    spans_in,
)

from engine_adapter.serving._server_runtime import AdapterRuntime
from engine_adapter.sglang import AdapterConfig, EvaluatorGrammar, structural_tag_for

pytestmark = pytest.mark.sglang

# A busy 2-core machine: "within the deadline" is asserted against deadline + this.
SLACK_S = 2.0


@pytest.fixture(scope="module")
def calc_tag(daemon: Daemon) -> str:
    return json.dumps(structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="Answer: <calc>"))


def runtime_of(backend: Any) -> AdapterRuntime:
    runtime: AdapterRuntime = backend._evald_runtime
    return runtime


def with_runtime(backend: Any, **settings: Any) -> Any:
    """The backend with other adapter settings (same tokenizer codec, same compiler)."""
    base = runtime_of(backend)
    clone = copy.copy(backend)
    config = AdapterConfig(**{**base.config.__dict__, **settings})
    clone._evald_runtime = AdapterRuntime(config, base.codec)
    return clone


def scheduler(backend: Any, tokenizer: Any, rows: list[Row]) -> MiniScheduler:
    return MiniScheduler(runtime_of(backend).codec, tokenizer.eos_token_id, len(tokenizer), rows)


def scripted(backend: Any, tokenizer: Any, script: str, seed: int = 0) -> ScriptedModel:
    return ScriptedModel(runtime_of(backend).codec, tokenizer.eos_token_id, script, seed=seed)


def run_one(backend: Any, tokenizer: Any, tag: str, script: str) -> tuple[str, Row]:
    grammar = backend.dispatch_structural_tag(tag)
    assert isinstance(grammar, EvaluatorGrammar)
    row = Row(grammar, scripted(backend, tokenizer, script))
    loop = scheduler(backend, tokenizer, [row])
    loop.run()
    return loop.text(row), row


def test_backend_hook_keeps_the_tokenizer(backend: Any, tokenizer: Any) -> None:
    runtime = runtime_of(backend)
    assert runtime.codec.vocab_size == backend._tokenizer_info.vocab_size == len(tokenizer)
    assert runtime.config.token == TOKEN


def test_span_gets_the_daemons_value_one_forced_token_per_step(
    backend: Any, tokenizer: Any, calc_tag: str
) -> None:
    # The script's own result is wrong (what the 135M model writes); the engine must win.
    text, row = run_one(
        backend, tokenizer, calc_tag, "Answer: <calc>17 * 23 + 91</calc><result>91</result> items."
    )
    assert row.aborted is None and row.grammar.fault is None
    ((content, region),) = spans_in(text, "calc")
    assert content == "17 * 23 + 91"
    assert region == expected_region("calc", content)
    assert text.split("</result>", 1)[1].startswith(" items."), "the model reads on"
    (span,) = row.grammar.spans
    assert (span.value, span.error_code) == (region[len("<result>") : -len("</result>")], None)
    # The script closes the span with the merged token "><", so only "result>…" is forced.
    forced = runtime_of(backend).codec.encode_continuation(region[1:].encode())
    assert row.grammar.forced_steps == len(row.forced_steps) == len(forced)
    assert row.forced_steps == list(range(row.forced_steps[0], row.forced_steps[0] + len(forced)))


def test_batch_of_values_errors_and_plain_rows(
    daemon: Daemon, backend: Any, tokenizer: Any
) -> None:
    calc = structural_tag_for(daemon.target, TOKEN, ["calc", "strop"], prefix="<calc>")
    strop_prefix = structural_tag_for(daemon.target, TOKEN, ["calc", "strop"], prefix="<strop>")
    scripts = [
        (None, "Just text, no spans."),
        (backend.dispatch_json('{"type": "object"}'), '{"a": 1}'),
        (json.dumps(calc), "<calc>1 / 0</calc><result>0</result> so it fails."),
        (json.dumps(strop_prefix), '<strop>count("strawberry", "r")</strop><result>2</result> r.'),
        (
            json.dumps(calc),
            "<calc>(2 + 3) * 4</calc><result>9</result>, <calc>7 - 10</calc><result>3</result>.",
        ),
    ]
    rows = []
    for grammar, script in scripts:
        if isinstance(grammar, str):
            grammar = backend.dispatch_structural_tag(grammar)
            assert isinstance(grammar, EvaluatorGrammar)
        rows.append(Row(grammar, scripted(backend, tokenizer, script), max_new_tokens=60))
    loop = scheduler(backend, tokenizer, rows)
    loop.run()
    assert all(row.aborted is None for row in rows)
    texts = [loop.text(row) for row in rows]
    assert texts[0].startswith("Just text, no spans.") and texts[1].startswith('{"a": 1}')
    assert not isinstance(rows[1].grammar, EvaluatorGrammar)
    (error,) = spans_in(texts[2], "calc")
    assert error == ("1 / 0", expected_region("calc", "1 / 0"))
    assert error[1] == "<result_error>division_by_zero</result_error>"
    (count,) = spans_in(texts[3], "strop")
    assert count[1] == expected_region("strop", count[0])
    two = spans_in(texts[4], "calc")
    assert [content for content, _ in two] == ["(2 + 3) * 4", "7 - 10"]
    assert all(region == expected_region("calc", content) for content, region in two)


def test_spans_closing_in_one_step_travel_in_one_message(
    backend: Any, tokenizer: Any, calc_tag: str
) -> None:
    client = runtime_of(backend).client
    rows = [
        Row(backend.dispatch_structural_tag(calc_tag), scripted(backend, tokenizer, script))
        for script in (
            "Answer: <calc>2 + 3</calc><result>0</result> ok",
            "Answer: <calc>4 * 5</calc><result>0</result> ok",
        )
    ]
    loop = scheduler(backend, tokenizer, rows)
    submitted, sent = client.stats.submitted, client.stats.messages_sent
    loop.run()
    assert client.stats.submitted - submitted == 2
    assert client.stats.messages_sent - sent == 1
    regions = [spans_in(loop.text(row), "calc")[0][1] for row in rows]
    assert regions == [expected_region("calc", "2 + 3"), expected_region("calc", "4 * 5")]


def test_evaluated_tag_request_is_lowered_and_evaluated(backend: Any, tokenizer: Any) -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Total: "},
                {
                    "type": "evaluated_tag",
                    "begin": "<calc>",
                    "end": "</calc>",
                    "evaluator": "calc",
                    "result": {"begin": "<result>", "end": "</result>"},
                },
                {"type": "const_string", "value": " items"},
            ],
        },
    }
    text, row = run_one(
        backend, tokenizer, json.dumps(tag), "Total: <calc>12 * 12</calc><result>1</result> items"
    )
    assert spans_in(text, "calc") == [("12 * 12", expected_region("calc", "12 * 12"))]
    assert row.grammar.is_terminated()


def test_openai_response_format_carries_the_spans(backend: Any, calc_tag: str) -> None:
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "17 * 23 + 91?"}]
    request = ChatCompletionRequest(
        model="m", messages=messages, response_format=json.loads(calc_tag)
    )
    params = request.to_sampling_params(stop=[], model_generation_config={})
    grammar = backend.dispatch_structural_tag(params["structural_tag"])
    assert isinstance(grammar, EvaluatorGrammar)
    assert grammar.bindings == backend.dispatch_structural_tag(calc_tag).bindings
    with pytest.raises(ValidationError, match="evaluated_tag"):
        ChatCompletionRequest(
            model="m",
            messages=messages,
            response_format={
                "type": "structural_tag",
                "format": {
                    "type": "evaluated_tag",
                    "begin": "<calc>",
                    "end": "</calc>",
                    "evaluator": "calc",
                    "result": {"begin": "<r>", "end": "</r>"},
                },
            },
        )


def test_plain_and_invalid_tags(backend: Any) -> None:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    plain = backend.dispatch_structural_tag(
        json.dumps({"type": "structural_tag", "format": {"type": "any_text"}})
    )
    assert type(plain) is XGrammarGrammar
    bad = backend.dispatch_structural_tag(
        json.dumps(
            {
                "type": "structural_tag",
                "format": {
                    "type": "evaluated_tag",
                    "begin": "<x>",
                    "end": "</x>",
                    "evaluator": "nope",
                    "result": {"begin": "<r>", "end": "</r>"},
                },
            }
        )
    )
    assert isinstance(bad, InvalidGrammarObject)
    assert "/format/evaluator" in bad.error_message and "'nope'" in bad.error_message


def test_deadline_when_the_daemon_is_stopped(
    daemon: Daemon, backend: Any, tokenizer: Any, calc_tag: str
) -> None:
    quick = with_runtime(backend, deadline_ms=300)
    script = "Answer: <calc>6 * 7</calc><result>1</result> done."
    os.kill(daemon.process.pid, signal.SIGSTOP)  # a hung daemon: connected, never answers
    try:
        text, row = run_one(quick, tokenizer, calc_tag, script)
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    assert row.aborted is None
    assert spans_in(text, "calc") == [("6 * 7", "<result_error>deadline_exceeded</result_error>")]
    (span,) = row.grammar.spans
    assert 0 < span.waited_s <= 0.3 + SLACK_S
    text, _ = run_one(quick, tokenizer, calc_tag, script)  # the daemon serves again
    assert spans_in(text, "calc") == [("6 * 7", expected_region("calc", "6 * 7"))]


@pytest.fixture
def doomed_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    handle = start_daemon(tmp_path_factory.mktemp("evald-doomed"), CONFIG)
    try:
        yield handle
    finally:
        handle.stop()


def test_evald_down_gives_unavailable_and_the_request_finishes(
    doomed_daemon: Daemon, backend: Any, tokenizer: Any, calc_tag: str
) -> None:
    elsewhere = with_runtime(backend, target=doomed_daemon.target, deadline_ms=3000)
    script = "Answer: <calc>2 ** 10</calc><result>1</result> done."
    text, _ = run_one(elsewhere, tokenizer, calc_tag, script)
    assert spans_in(text, "calc") == [("2 ** 10", expected_region("calc", "2 ** 10"))]
    doomed_daemon.kill()
    text, row = run_one(elsewhere, tokenizer, calc_tag, script)
    assert row.aborted is None and row.finished
    # `unavailable`, not `deadline_exceeded`: the adapter did not wait for the deadline.
    assert spans_in(text, "calc") == [("2 ** 10", "<result_error>unavailable</result_error>")]


def test_rollback_restores_matcher_and_spans(backend: Any, tokenizer: Any, calc_tag: str) -> None:
    import torch

    codec = runtime_of(backend).codec
    grammar = backend.dispatch_structural_tag(calc_tag)
    mask = grammar.allocate_vocab_mask(len(tokenizer), 1, "cpu")

    def step(g: EvaluatorGrammar, wanted: int | None = None) -> int:
        g.fill_vocab_mask(mask, 0)
        row = mask[0]
        if wanted is None:  # the forced token: the only one left in the row
            (word,) = torch.nonzero(row != 0).flatten().tolist()
            bits = int(row[word]) & 0xFFFFFFFF
            wanted = word * 32 + bits.bit_length() - 1
        g.accept_token(wanted)
        return wanted

    prefix = codec.encode_continuation(b"Answer: <calc>9 - 4</calc>")
    for token in prefix:
        step(grammar, token)
    assert grammar.injector.pending
    forced = [step(grammar) for _ in range(3)]  # "<", "result", ">" (or their merges)
    assert codec.decode(forced).startswith(b"<result")
    grammar.rollback(len(forced) + 1)  # back to before the closing token
    fresh = grammar.copy()
    for token in prefix[:-1]:
        fresh.accept_token(token)
    assert grammar.injector.text == fresh.injector.text
    assert grammar.spans == [] and not grammar.injector.pending
    other = fresh.allocate_vocab_mask(len(tokenizer), 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    fresh.fill_vocab_mask(other, 0)
    assert torch.equal(mask, other), "the matcher is back where a fresh one is"
    step(grammar, prefix[-1])  # closes the span again: submitted again
    while grammar.injector.pending:
        step(grammar)
    assert grammar.injector.text.endswith(expected_region("calc", "9 - 4"))
    assert len(grammar.spans) == 1


def test_copy_is_a_fresh_request_as_in_sglangs_cache(backend: Any, calc_tag: str) -> None:
    key = ("structural_tag", calc_tag)
    value, hit = backend.get_cached_or_future_value(key, False)
    assert not hit
    grammar = value.result(timeout=120)
    assert isinstance(grammar, EvaluatorGrammar)
    grammar.accept_token(runtime_of(backend).codec.encode_continuation(b"Answer")[0])
    backend.set_cache(key, grammar.copy())  # what GrammarManager stores
    try:
        cached, hit = backend.get_cached_or_future_value(key, False)
        assert hit and isinstance(cached, EvaluatorGrammar)
        assert cached.injector.num_tokens == 0 and cached.bindings == grammar.bindings
        assert cached.grammar is not grammar.grammar and cached.runtime is grammar.runtime
        assert grammar.injector.num_tokens == 1
    finally:
        backend.cache.pop(key, None)


def test_reasoning_frame_keeps_the_adapter(backend: Any, calc_tag: str) -> None:
    grammar = backend.dispatch_structural_tag(calc_tag)
    framed = backend.compile_framed_grammar(
        grammar,
        lambda content: {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [{"type": "const_string", "value": "<think>ok</think>"}, content],
            },
        },
    )
    assert isinstance(framed, EvaluatorGrammar) and framed.bindings == grammar.bindings
    assert framed.grammar is not grammar.grammar


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_never_abort_and_every_value_is_right(
    backend: Any, tokenizer: Any, daemon: Daemon, seed: int
) -> None:
    tag = structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="<calc>")
    grammar = backend.dispatch_structural_tag(json.dumps(tag))
    codec = runtime_of(backend).codec
    row = Row(grammar, RandomModel(codec, seed=seed), max_new_tokens=48)
    loop = scheduler(backend, tokenizer, [row])
    loop.run()
    assert row.aborted is None and grammar.fault is None
    text = loop.text(row)
    closed = spans_in(text, "calc")
    assert len(closed) == len([s for s in grammar.spans if s.injected is not None])
    for content, region in closed:
        assert region == expected_region("calc", content)
    assert closed, f"seed {seed} closed no span in 48 tokens: {text!r}"
