"""The adapter next to vLLM's own n-gram proposer (``--speculative-config`` method ``ngram``) in a
real vLLM CPU server: drafts copied from the prompt never carry a span's result region past the
adapter, and the results still go in through the verify step.

The prompt repeats a span with a wrong value (``<result>99</result>``), so the proposer drafts
``</calc><result>99</result>`` right where the model closes the same span. Were those drafts
verified, the model's own ``99`` would be kept (checked by removing the cut: every answer then
says 99); the adapter cuts the drafts before the span's closing token, and evald's value goes in.
"""

from __future__ import annotations

from typing import Any

import pytest
from daemon_harness import Daemon
from test_vllm_server import CONCURRENCY, evald_answer, run_all, spans_in, text_of

from engine_adapter.testing.vllm import TOKEN, VllmServer, fixed_tag, tag_body

pytestmark = pytest.mark.vllm


def test_proposer_drafts_never_skip_a_span_boundary(
    ngram_server: VllmServer, daemon: Daemon, specs: Any
) -> None:
    calc = specs["calc"].binding()
    content = "123 * 457"
    prompt = "Compute:\n" + f"So <calc>{content}</calc><result>99</result>.\n" * 4
    tag = fixed_tag("So ", (calc, content), ".\nSo ", (calc, content), ".")
    value, _ = evald_answer(daemon, "calc", content)
    before = ngram_server.counters()
    answers = run_all(
        [lambda: ngram_server.complete(prompt, max_tokens=120, **tag_body(tag, evald_token=TOKEN))]
        * CONCURRENCY
    )
    after = ngram_server.counters()
    for answer in answers:
        assert [f[2] for f in spans_in(text_of(answer))] == [value, value], text_of(answer)
    # The proposer did draft (the prompt's spans), and the verify step kept drafts.
    accepted = after["spec_decode_num_accepted_tokens_total"]
    assert accepted - before.get("spec_decode_num_accepted_tokens_total", 0.0) > 0


def test_values_and_errors_next_to_ngram_drafts(
    ngram_server: VllmServer, daemon: Daemon, specs: Any
) -> None:
    calc = specs["calc"].binding()
    contents = [f"{17 + i} * {23 + i} + {91 * i}" for i in range(CONCURRENCY - 2)]
    contents += ["1 / 0", "2 ** 3 ** 2"]
    answers = run_all(
        [
            (lambda c=c: ngram_server.complete(
                "Compute:", max_tokens=160,
                **tag_body(fixed_tag("So ", (calc, c), " and ", (calc, c), "."),
                           evald_token=TOKEN),
            ))
            for c in contents
        ]
    )  # fmt: skip
    for content, answer in zip(contents, answers, strict=True):
        found = spans_in(text_of(answer))
        expected = evald_answer(daemon, "calc", content)
        assert [(f[1], f[2], f[3]) for f in found] == [(content, *expected)] * 2, text_of(answer)
        assert answer["choices"][0]["finish_reason"] == "stop"
