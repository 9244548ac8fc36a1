"""Computed fields (issue 46) on the real vLLM CPU server, for each way of forcing results:
``structured_outputs={"json": …}`` and the OpenAI API's ``response_format``, streamed,
per-request tenants (``vllm_xargs``), the operands text, a refused schema (HTTP 400 naming the
field) and evald gone (in band, valid JSON).

Every forced value is checked against evald's own answer, every document against the lowered
schema (docs/computed-fields.md).
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from computed_tenant import register_policy
from daemon_harness import Daemon

from engine_adapter.testing import (
    ECHO,
    ESSAY_PROMPT,
    ESSAY_SCHEMA,
    NARRATED_SCHEMA,
    POLICY,
    VERDICT,
    calc_value,
    checked_document,
    extraction_schema,
    http_error,
    numbers_in,
    policy_schema,
    unknown_evaluator_schema,
)
from engine_adapter.testing.vllm import SPIN_TOKEN, TOKEN, VllmServer

pytestmark = pytest.mark.vllm


def json_body(schema: dict[str, Any], **xargs: str) -> dict[str, Any]:
    body: dict[str, Any] = {"structured_outputs": {"json": schema}}
    if xargs:
        body["vllm_xargs"] = dict(xargs)
    return body


@pytest.mark.timeout(900)  # may be the first test of a server (it starts)
def test_essay_value_arrives_in_the_stream(server: VllmServer, daemon: Daemon, specs: Any) -> None:
    """``structured_outputs.json``, streamed: ``answer`` is calc's value for the expression the
    model wrote, it is in the stream before the model writes on (``comment``) and the stream
    ends, the document compact and valid."""
    texts = server.stream_texts(ESSAY_PROMPT, max_tokens=80, **json_body(NARRATED_SCHEMA))
    final = texts[-1]
    document = checked_document(final, NARRATED_SCHEMA, list(specs.values()))
    assert document["answer"] == calc_value(daemon.target, TOKEN, document["expression"]), final
    value = f'"answer": {json.dumps(document["answer"])}'
    arrived = next(i for i, text in enumerate(texts) if value in text)
    assert len(texts[arrived]) < len(final), texts  # the model wrote on after it arrived


def test_openai_response_format_with_a_request_tenants_policy(
    server: VllmServer, daemon: Daemon
) -> None:
    """``response_format`` json_schema through the chat API, the tenant's token in
    ``vllm_xargs``: that tenant's evaluators compute the facts object and the decision object
    from the facts the model wrote; the server's own tenant, which has no such evaluator, gets
    a 400."""
    specs = register_policy(daemon.target, SPIN_TOKEN, TOKEN)
    schema = policy_schema(ECHO, POLICY)
    message = [{"role": "user", "content": "I am 34 and the parts cost 6500 and 1200. Book me?"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "booking", "schema": schema}}
    answer = server.chat(
        message,
        max_tokens=120,
        response_format=response_format,
        vllm_xargs={"evald_token": SPIN_TOKEN},
    )
    text = answer["choices"][0]["message"]["content"]
    document = checked_document(text, schema, specs)
    assert document["facts"] == {"age": document["age"], "components": document["components"]}
    assert document["decision"] == VERDICT, text
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    refused = http_error(
        lambda: server.chat(message, max_tokens=60, response_format=response_format)
    )
    assert "HTTP 400" in refused and "/properties/facts/computed/by" in refused, refused
    assert SPIN_TOKEN not in server.log()


def test_operands_text_narrows_extracted_properties(server: VllmServer, specs: Any) -> None:
    """``evald_operands_from`` travels in ``vllm_xargs``: the ``extracted`` number can only be
    one of that text's numbers (ones the model would never write unasked), and ``same`` is
    computed from it."""
    operands = "The codes are 8675309 and 4242."
    body = json_body(extraction_schema(), evald_token=TOKEN, evald_operands_from=operands)
    answer = server.complete("Pick a number as JSON: ", max_tokens=40, **body)
    text = answer["choices"][0]["text"]
    document = checked_document(text, extraction_schema(), list(specs.values()))
    assert document["n"] in numbers_in(operands), text
    assert document["same"] == document["n"], text


def test_unknown_evaluator_is_http_400_naming_the_field(server: VllmServer) -> None:
    """``structured_outputs`` and ``response_format`` alike; the server keeps serving."""
    schema = unknown_evaluator_schema()
    native = http_error(lambda: server.complete(ESSAY_PROMPT, max_tokens=20, **json_body(schema)))
    response_format = {"type": "json_schema", "json_schema": {"name": "essay", "schema": schema}}
    chat = http_error(
        lambda: server.chat(
            [{"role": "user", "content": "6 * 7?"}], max_tokens=20, response_format=response_format
        )
    )
    for refused in (native, chat):
        assert refused.startswith("HTTP 400"), refused
        assert "/properties/answer/computed/by: unknown evaluator 'no_such_evaluator'" in refused
    assert server.complete("The capital of France is", max_tokens=4)["choices"][0]["text"]


def test_stopped_evald_forces_an_error_object_and_valid_json(
    server: VllmServer, specs: Any, fault_daemon: Daemon
) -> None:
    """The tenant's evald (``evald_target``) is killed after the API server listed its
    evaluators: the computed value is ``{"$error": "unavailable"}`` (or ``deadline_exceeded``),
    in band, and the document still validates."""
    body = json_body(ESSAY_SCHEMA, evald_token=TOKEN, evald_target=fault_daemon.target)
    first = server.complete(ESSAY_PROMPT, max_tokens=60, **body)["choices"][0]["text"]
    document = checked_document(first, ESSAY_SCHEMA, list(specs.values()))
    assert isinstance(document["answer"], int | float), first
    fault_daemon.process.send_signal(signal.SIGKILL)
    fault_daemon.process.wait(timeout=10)
    answer = server.complete(ESSAY_PROMPT, max_tokens=60, **body)["choices"][0]
    document = checked_document(answer["text"], ESSAY_SCHEMA, list(specs.values()))
    assert document["answer"] in ({"$error": "unavailable"}, {"$error": "deadline_exceeded"})
    assert answer["finish_reason"] == "stop", answer
