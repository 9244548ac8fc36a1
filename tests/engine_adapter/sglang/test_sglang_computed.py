"""Computed fields (issue 46) on real SGLang CPU servers, under both schedulers: the native
``json_schema`` and the OpenAI API's ``response_format``, streamed, per-request tenants, the
operands text, a refused schema (HTTP 400 naming the field) and evald gone (in band, valid JSON).

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
from engine_adapter.testing.sglang import SPIN_TOKEN, TOKEN, SglangServer

pytestmark = pytest.mark.sglang_server


@pytest.mark.timeout(900)  # may be the first test of a scheduler (its server starts)
def test_essay_value_arrives_in_the_stream(
    server: SglangServer, server_daemon: Daemon, server_specs: Any
) -> None:
    """Native ``json_schema``, streamed: ``answer`` is calc's value for the expression the
    model wrote, it is in the streamed text before the model writes on (``comment``) and the
    stream ends, and the document is compact and valid."""
    texts = server.stream_texts(ESSAY_PROMPT, max_new_tokens=80, json_schema=NARRATED_SCHEMA)
    final = texts[-1]
    specs = list(server_specs.values())
    document = checked_document(final, NARRATED_SCHEMA, specs)
    expected = calc_value(server_daemon.target, TOKEN, document["expression"])
    assert document["answer"] == expected, final
    value = f'"answer": {json.dumps(document["answer"])}'
    arrived = next(i for i, text in enumerate(texts) if value in text)
    assert len(texts[arrived]) < len(final), texts  # the model wrote on after it arrived


def test_openai_response_format_with_a_request_tenants_policy(
    server: SglangServer, server_daemon: Daemon, server_specs: Any
) -> None:
    """``response_format`` json_schema through the chat API, the tenant's token in
    ``custom_params``: that tenant's evaluators compute the facts object and the decision
    object from the facts the model wrote; the server's own tenant, which has no such
    evaluator, gets a 400."""
    specs = register_policy(server_daemon.target, SPIN_TOKEN, TOKEN)
    schema = policy_schema(ECHO, POLICY)
    message = "I am 34 and the repair parts cost 6500 and 1200. Can you book me?"
    response_format = {"type": "json_schema", "json_schema": {"name": "booking", "schema": schema}}
    answer = server.chat(
        [{"role": "user", "content": message}],
        max_tokens=120,
        response_format=response_format,
        custom_params={"evald_token": SPIN_TOKEN},
    )
    text = answer["choices"][0]["message"]["content"]
    document = checked_document(text, schema, specs)
    assert document["facts"] == {"age": document["age"], "components": document["components"]}
    assert document["decision"] == VERDICT, text
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    refused = http_error(
        lambda: server.chat(
            [{"role": "user", "content": message}], max_tokens=60, response_format=response_format
        )
    )
    assert "HTTP 400" in refused and "/properties/facts/computed/by" in refused, refused
    assert SPIN_TOKEN not in server.log()


def test_operands_text_narrows_extracted_properties(
    server: SglangServer, server_daemon: Daemon, server_specs: Any
) -> None:
    """``evald_operands_from`` travels in ``custom_params``: the ``extracted`` number can only
    be one of that text's numbers (ones the model would never write unasked), and ``same`` is
    computed from it."""
    operands = "The codes are 8675309 and 4242."
    answer = server.generate(
        "Pick a number as JSON: ",
        max_new_tokens=40,
        json_schema=extraction_schema(),
        custom_params={"evald_token": TOKEN, "evald_operands_from": operands},
    )
    specs = list(server_specs.values())
    document = checked_document(answer["text"], extraction_schema(), specs)
    assert document["n"] in numbers_in(operands), answer["text"]
    assert document["same"] == document["n"], answer["text"]


def test_unknown_evaluator_is_http_400_naming_the_field(server: SglangServer) -> None:
    """Native and OpenAI API alike; the server keeps serving."""
    schema = unknown_evaluator_schema()
    native = http_error(
        lambda: server.generate(ESSAY_PROMPT, max_new_tokens=20, json_schema=schema)
    )
    response_format = {"type": "json_schema", "json_schema": {"name": "essay", "schema": schema}}
    chat = http_error(
        lambda: server.chat(
            [{"role": "user", "content": "6 * 7?"}], max_tokens=20, response_format=response_format
        )
    )
    for refused in (native, chat):
        assert refused.startswith("HTTP 400"), refused
        assert "/properties/answer/computed/by: unknown evaluator 'no_such_evaluator'" in refused
    assert server.generate("The capital of France is", max_new_tokens=4)["text"]


def test_stopped_evald_forces_an_error_object_and_valid_json(
    server: SglangServer, server_specs: Any, fault_daemon: Daemon
) -> None:
    """The tenant's evald (``evald_target``) is killed after its evaluators were listed: the
    computed value is ``{"$error": "unavailable"}`` (or ``deadline_exceeded``), in band, and the
    document still validates."""
    params = {"evald_token": TOKEN, "evald_target": fault_daemon.target}
    specs = list(server_specs.values())
    first = server.generate(
        ESSAY_PROMPT, max_new_tokens=60, json_schema=ESSAY_SCHEMA, custom_params=params
    )
    document = checked_document(first["text"], ESSAY_SCHEMA, specs)
    assert isinstance(document["answer"], int | float), first["text"]
    fault_daemon.process.send_signal(signal.SIGKILL)
    fault_daemon.process.wait(timeout=10)
    answer = server.generate(
        ESSAY_PROMPT, max_new_tokens=60, json_schema=ESSAY_SCHEMA, custom_params=params
    )
    document = checked_document(answer["text"], ESSAY_SCHEMA, specs)
    assert document["answer"] in ({"$error": "unavailable"}, {"$error": "deadline_exceeded"})
    assert answer["meta_info"]["finish_reason"]["type"] == "stop", answer["meta_info"]
