"""The local CPU engine end to end: the real SmolLM2 (llama.cpp), the real tokenizer and XGrammar
matcher, and the real evald daemon (``evald serve`` on a unix socket) or the in-process
evaluators. Model output is never hard-coded: the tests assert properties of whatever the model
writes (the injected value is the evaluator's value of the span the model wrote; the tokens after
it were computed from a KV cache that holds the injected tokens).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_adapter import EvaluatorClient, ReferenceEvaluator, list_evaluators
from engine_adapter.local import EngineError, GenerationResult, LocalEngine
from engine_adapter.spans._grammar import standard_evaluators

pytestmark = pytest.mark.model

PROMPT = "A box has 17 rows of 23 items, then 91 more are added. How many items are in the box?"
PREFIX = "The expression is <calc>"
# Margin for a busy 2-core machine when asserting "within the deadline".
SLACK_S = 3.0

CONFIG = """
[server]
threads = 2
shutdown_grace_s = 1

[[tenants]]
name = "local"
evaluators = ["*"]
"""


def _start_daemon(root: Path) -> Any:
    from daemon_harness import start_daemon

    return start_daemon(root, CONFIG)


def _evald_value(daemon: Any, evaluator: str, content: str) -> str:
    """What the daemon answers for a span, asked directly (unary Evaluate)."""
    from evald.client import Client
    from evald.contract import ErrorCode

    with Client(daemon.target) as client:
        response = client.evaluate(evaluator, content)
    if response.WhichOneof("outcome") == "value":
        return f"<result>{response.value}</result>"
    return f"<result_error>{ErrorCode.from_proto(response.error.code).value}</result_error>"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    handle = _start_daemon(tmp_path_factory.mktemp("evald"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def reference() -> Iterator[ReferenceEvaluator]:
    with ReferenceEvaluator(["calc", "strop", "date"]) as evaluator:
        yield evaluator


@pytest.fixture(scope="module")
def engine(llama_backend: Any, smollm2_tokenizer: Any, reference: ReferenceEvaluator) -> Any:
    """An engine over calc, strop and date with the Python reference as its default evaluator
    (tests that need evald pass ``evaluator=`` per request)."""
    return LocalEngine(
        llama_backend,
        smollm2_tokenizer,
        standard_evaluators(["calc", "strop", "date"]),
        evaluator=reference,
        deadline_ms=3000,
    )


def _replayed_next_token(engine: Any, result: GenerationResult, upto: int, prefix: str) -> int:
    """The greedy, grammar-masked token after ``result.token_ids[:upto]``, recomputed from the
    engine's own KV cache rolled back to that point (rollback is exact; see test_backend)."""
    import xgrammar as xgr

    backend = engine.backend
    prompt_len = len(engine.prompt_ids(PROMPT))
    assert backend.tokens == tuple(engine.prompt_ids(PROMPT)) + tuple(result.token_ids)
    backend.truncate(prompt_len + upto - 1)
    logits = backend.forward([result.token_ids[upto - 1]])
    matcher = xgr.GrammarMatcher(engine.compile(engine.span_grammar("grammar-eval", prefix)))
    for token in result.token_ids[:upto]:
        assert matcher.accept_token(token)
    mask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), mask)
    return int(torch.argmax(logits))


def test_injected_result_is_evalds_value_and_the_model_continues_from_it(
    engine: Any, daemon: Any, smollm2_tokenizer: Any
) -> None:
    with EvaluatorClient(daemon.target) as client:
        assert client.wait_connected(30.0)
        specs = list_evaluators(daemon.target)
        evald_engine = LocalEngine(
            engine.backend, smollm2_tokenizer, specs, evaluator=client, deadline_ms=3000
        )
        result = evald_engine.generate(
            PROMPT, mode="grammar-eval", prefix=PREFIX, max_new_tokens=24
        )
    assert result.spans, result.text
    span = result.spans[0]
    assert span.evaluator == "calc"
    # The span the model wrote, then exactly what evald answers for it.
    assert span.forced_text == _evald_value(daemon, "calc", span.content)
    assert f"<calc>{span.content}</calc>{span.forced_text}" in result.text
    assert result.text.startswith(PREFIX)
    # The forced tokens are in the sequence (and so in the KV cache) right where they were
    # forced, all carried by one forward together with the sampled token that closed the span.
    forced = result.token_ids[span.forced_at : span.forced_at + span.n_forced_tokens]
    assert span.forced_text.endswith(smollm2_tokenizer.decode(forced))
    inject_steps = [s for s in result.steps if s.kind == "inject"]
    assert len(inject_steps) == 1 and inject_steps[0].n_forwarded == 1 + span.n_forced_tokens
    # What follows was computed from a cache holding the injected result: replaying the cache
    # up to the last forced token gives the very token the engine produced next.
    after = span.forced_at + span.n_forced_tokens
    expected_next = (
        result.token_ids[after] if after < len(result.token_ids) else engine.backend.eos_token_id
    )
    if after < len(result.token_ids) or result.stop_reason == "eos":
        assert _replayed_next_token(evald_engine, result, after, PREFIX) == expected_next


def test_evald_stopped_mid_run_still_finishes_with_unavailable(
    engine: Any, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    daemon = _start_daemon(tmp_path)
    deadline_ms = 2000
    try:
        with EvaluatorClient(daemon.target) as client:
            assert client.wait_connected(30.0)
            stopped: list[float] = []

            def stop_evald(text: str, forced: bool) -> None:
                if not forced and not stopped:  # the model is inside <calc>, writing its span
                    daemon.stop()
                    stopped.append(time.monotonic())

            started = time.monotonic()
            result = engine.generate(
                PROMPT,
                mode="grammar-eval",
                prefix=PREFIX,
                max_new_tokens=24,
                evaluator=client,
                on_text=stop_evald,
            )
            elapsed = time.monotonic() - started
    finally:
        daemon.stop()
    assert stopped, "the daemon was stopped during generation"
    assert not daemon.alive()
    assert result.stop_reason in ("eos", "max_new_tokens")
    assert result.spans, result.text
    span = result.spans[0]
    assert span.forced_text == "<result_error>unavailable</result_error>"
    assert f"</calc>{span.forced_text}" in result.text
    assert span.wait_us / 1e6 <= deadline_ms / 1000 + SLACK_S
    assert elapsed < 120, "generation finished"


def test_hung_evald_gives_deadline_exceeded_at_the_span_deadline(
    llama_backend: Any, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    daemon = _start_daemon(tmp_path)
    deadline_ms = 300
    try:
        with EvaluatorClient(daemon.target) as client:
            assert client.wait_connected(30.0)
            engine = LocalEngine(
                llama_backend,
                smollm2_tokenizer,
                standard_evaluators(["calc"]),
                evaluator=client,
                deadline_ms=deadline_ms,
            )
            hung: list[bool] = []

            def hang_evald(text: str, forced: bool) -> None:
                if not forced and not hung:
                    os.kill(daemon.process.pid, signal.SIGSTOP)  # a real hang
                    hung.append(True)

            try:
                result = engine.generate(
                    PROMPT, prefix=PREFIX, max_new_tokens=20, on_text=hang_evald
                )
            finally:
                os.kill(daemon.process.pid, signal.SIGCONT)
    finally:
        daemon.stop()
    assert result.spans, result.text
    span = result.spans[0]
    assert span.forced_text == "<result_error>deadline_exceeded</result_error>"
    assert span.wait_us / 1e6 <= deadline_ms / 1000 + SLACK_S


def test_the_three_modes(engine: Any, smollm2_tokenizer: Any) -> None:
    from evaluators_wasm.reference import reference

    free = engine.generate(PROMPT, mode="no-grammar", max_new_tokens=12)
    assert free.spans == [] and free.n_forced == 0
    assert free.mode == "no-grammar" and free.n_sampled <= 12

    prefix_tokens = len(smollm2_tokenizer.encode(PREFIX, add_special_tokens=False))
    stop = ("</result>",)
    written = engine.generate(
        PROMPT, mode="grammar-no-eval", prefix=PREFIX, max_new_tokens=40, stop=stop
    )
    assert written.n_forced == prefix_tokens, "only the prefix is forced"
    assert written.spans and written.spans[0].forced_text == ""
    # Nothing was forced for it: no forced tokens, no forward carried them, nothing awaited.
    unforced = written.spans[0]
    assert (unforced.n_forced_tokens, unforced.forced_at, unforced.inject_forward_us) == (0, -1, 0)
    assert unforced.wait_us == 0 and all(step.kind != "inject" for step in written.steps)
    # The grammar makes the model write a result region right after the span.
    assert f"<calc>{written.spans[0].content}</calc><result>" in written.text

    evaluated = engine.generate(
        PROMPT, mode="grammar-eval", prefix=PREFIX, max_new_tokens=40, stop=stop
    )
    assert evaluated.stop_reason == "stop" and evaluated.text.endswith("</result>")
    span = evaluated.spans[0]
    assert span.value == reference("calc")(span.content.encode())
    assert evaluated.n_forced == prefix_tokens + span.n_forced_tokens
    assert evaluated.text.endswith(f"<calc>{span.content}</calc><result>{span.value}</result>")


def test_streamed_text_is_the_answer_and_marks_forced_text(engine: Any) -> None:
    chunks: list[tuple[str, bool]] = []
    result = engine.generate(
        PROMPT,
        prefix=PREFIX,
        max_new_tokens=30,
        stop=("</result>",),
        on_text=lambda text, forced: chunks.append((text, forced)),
    )
    assert "".join(text for text, _ in chunks) == result.text
    assert chunks[0] == (PREFIX, True)
    forced_text = "".join(text for text, forced in chunks[1:] if forced)
    assert result.spans and forced_text.endswith(result.spans[0].forced_text[-5:])


def test_timings_account_for_the_generation(engine: Any, smollm2_tokenizer: Any) -> None:
    """Every forward is one step with its kind and size; the inject step's wait and forward are
    its span's; the streaming callback's time falls in the decode but in no step's phase."""
    callback_s = 1.0
    slept: list[bool] = []

    def slow_reader(text: str, forced: bool) -> None:
        if not forced and not slept:  # the first sampled text: in the first decode step
            time.sleep(callback_s)
            slept.append(True)

    result = engine.generate(
        PROMPT, prefix=PREFIX, max_new_tokens=30, stop=("</result>",), on_text=slow_reader
    )
    assert result.stop_reason == "stop" and result.spans, result.text
    n_prefix = len(smollm2_tokenizer.encode(PREFIX, add_special_tokens=False))
    prefill, *steps = result.steps
    assert prefill.kind == "prefill" and prefill.forward_us == result.prefill_us
    assert prefill.n_forwarded == result.prompt_tokens + n_prefix - result.reused_cache_tokens
    # Each sampled token and each forced one went through exactly one forward after the prefill.
    assert result.n_forwards == len(steps) == result.n_sampled
    assert sum(step.n_forwarded for step in steps) == len(result.token_ids) - n_prefix
    (inject,) = [step for step in steps if step.kind == "inject"]
    span = result.spans[0]
    assert (inject.wait_us, inject.forward_us) == (span.wait_us, span.inject_forward_us)
    assert inject.n_forwarded == 1 + span.n_forced_tokens
    assert all(step.wait_us == 0 for step in steps if step.kind == "sample")
    # The reader slept inside the decode, in step 1, but outside every timed phase.
    first = steps[0]
    phases_us = first.mask_us + first.sample_us + first.accept_us + first.wait_us
    assert phases_us + first.forward_us < callback_s * 1e6
    assert result.decode_us >= callback_s * 1e6 + sum(step.forward_us for step in steps)
    assert result.grammar_compile_us > 0
    assert result.total_us >= result.grammar_compile_us + result.prefill_us + result.decode_us
    free = engine.generate(PROMPT, mode="no-grammar", max_new_tokens=3)
    assert free.grammar_compile_us == 0 and len(free.steps) == 1 + free.n_forwards


def test_kv_cache_reuse_gives_the_same_answer(engine: Any) -> None:
    prompt_len = len(engine.prompt_ids(PROMPT))
    first = engine.generate(PROMPT, mode="no-grammar", max_new_tokens=8)
    again = engine.generate(PROMPT, mode="no-grammar", max_new_tokens=8)
    assert again.reused_cache_tokens == prompt_len - 1
    engine.backend.reset()
    cold = engine.generate(PROMPT, mode="no-grammar", max_new_tokens=8)
    assert cold.reused_cache_tokens == 0
    assert first.token_ids == again.token_ids == cold.token_ids


def test_seeded_sampling_is_reproducible(engine: Any) -> None:
    runs = [
        engine.generate(
            PROMPT, mode="no-grammar", max_new_tokens=10, temperature=0.9, seed=seed
        ).token_ids
        for seed in (7, 7)
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_operands_from_the_prompt_narrow_what_the_span_is_written_from(engine: Any) -> None:
    """Whatever the model writes, every number in its span is one of the prompt's; on a prompt
    without numbers the option is off and the result says why."""
    import re

    from evaluators_wasm.reference import GuestError, reference

    result = engine.generate(PROMPT, prefix=PREFIX, max_new_tokens=24, operands_from=True)
    assert result.operands is not None and result.operands["applied"]
    assert result.operands["evaluators"]["calc"]["literals"] == {"number": ["17", "23", "91"]}
    (span,) = result.spans
    assert set(re.findall(r"[0-9]+", span.content)) <= {"17", "23", "91"}, span.content
    try:
        expected = f"<result>{reference('calc')(span.content.encode())}</result>"
    except GuestError as exc:
        expected = f"<result_error>{exc.code}</result_error>"
    assert span.forced_text == expected  # evaluated as ever: the option narrows only the setup
    other = engine.generate(
        PROMPT, prefix=PREFIX, max_new_tokens=24, operands_from="Use 5 and 7 only."
    )
    written = other.text[len(PREFIX) :].split("</calc>")[0]  # closed or not
    assert written and set(re.findall(r"[0-9]+", written)) <= {"5", "7"}, written
    off = engine.generate(
        "How many r's are in strawberry?", prefix=PREFIX, max_new_tokens=6, operands_from=True
    )
    assert off.operands is not None
    assert off.operands["evaluators"]["calc"]["literals"] == {}
    assert "no literal" in off.operands["evaluators"]["calc"]["reason"]
    assert engine.generate(PROMPT, prefix=PREFIX, max_new_tokens=2).operands is None
    with pytest.raises(EngineError, match="operands_from narrows the engine's span grammar"):
        engine.generate(
            PROMPT, grammar=engine.span_grammar("grammar-eval"), operands_from=True
        )


def test_zero_budget_returns_the_prefix(engine: Any) -> None:
    result = engine.generate(PROMPT, prefix=PREFIX, max_new_tokens=0)
    assert result.text == PREFIX and result.n_sampled == 0
    assert result.stop_reason == "max_new_tokens"


def test_bad_requests_are_engine_errors(engine: Any) -> None:
    with pytest.raises(EngineError, match="opens '<calc>' before its end"):
        engine.generate(PROMPT, prefix="<calc>1 + 1</calc> so", max_new_tokens=4)
    # A grammar without the prefix built in: the matcher itself refuses the prefix.
    grammar = engine.span_grammar("grammar-eval")
    with pytest.raises(EngineError, match="does not fit"):
        engine.generate(PROMPT, prefix="<calc>abc", grammar=grammar, max_new_tokens=4)
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.generate(PROMPT, max_new_tokens=-1)
    with pytest.raises(EngineError, match="top_p"):
        engine.generate(PROMPT, temperature=-1.0)
    with pytest.raises(EngineError, match="mode"):
        engine.generate(PROMPT, mode="sometimes")
    bare = LocalEngine(engine.backend, engine.tokenizer, engine.evaluators)
    with pytest.raises(EngineError, match="needs an evaluator"):
        bare.generate(PROMPT, mode="grammar-eval")
    with pytest.raises(EngineError, match="no evaluator 'nope'"):
        engine.span_grammar("grammar-eval", content_grammars={"nope": 'root ::= "1"'})
    # The engine still works after refusing.
    assert engine.generate(PROMPT, mode="no-grammar", max_new_tokens=2).n_sampled == 2
