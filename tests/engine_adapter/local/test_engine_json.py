"""Computed fields on the local engine end to end: the real SmolLM2, the real evald daemon over a
unix socket, the JSON schema a user sends. Model output is never hard-coded: the tests assert that
whatever the model writes, the document is valid and its computed values are evald's answers for
what the model wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine_adapter import EvaluatorClient, list_evaluators
from engine_adapter.local import EngineError, LocalEngine

pytestmark = pytest.mark.model

CONFIG = """
[server]
threads = 2
shutdown_grace_s = 1

[[tenants]]
name = "local"
evaluators = ["*"]
"""
PROMPT = "A box has 17 rows of 23 items, then 91 more are added. How many items are in the box?"
ESSAY = {
    "type": "object",
    "properties": {
        "expression": {"type": "string", "pattern": "^[0-9]{1,3}( [*+] [0-9]{1,3}){1,3}$"},
        "answer": {"type": "number", "computed": {"by": "calc", "from": "/expression"}},
        "sentence": {"type": "string", "maxLength": 80},
    },
    "required": ["expression", "answer", "sentence"],
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from daemon_harness import start_daemon

    handle = start_daemon(tmp_path_factory.mktemp("evald"), CONFIG)
    try:
        yield handle
    finally:
        handle.stop()


def _evald_value(daemon: Any, content: str) -> Any:
    from evald.client import Client

    with Client(daemon.target) as client:
        response = client.evaluate("calc", content)
    assert response.WhichOneof("outcome") == "value", response
    return json.loads(response.value)


def test_the_computed_value_is_evalds_answer_and_arrives_in_the_stream(
    daemon: Any, llama_backend: Any, smollm2_tokenizer: Any
) -> None:
    chunks: list[tuple[str, bool]] = []
    with EvaluatorClient(daemon.target) as client:
        assert client.wait_connected(30.0)
        engine = LocalEngine(
            llama_backend,
            smollm2_tokenizer,
            list_evaluators(daemon.target),
            evaluator=client,
            deadline_ms=3000,
        )
        result = engine.generate(
            PROMPT,
            json_schema=ESSAY,
            max_new_tokens=80,
            on_text=lambda text, forced: chunks.append((text, forced)),
        )
    document = json.loads(result.text)
    jsonschema.validate(document, ESSAY)
    assert document["answer"] == _evald_value(daemon, document["expression"])
    (span,) = result.spans
    assert (span.field, span.evaluator, span.content) == ("/answer", "calc", document["expression"])
    # The value was forced (never sampled) and streamed as such, before the model went on.
    forced = "".join(text for text, is_forced in chunks if is_forced)
    assert f'"answer": {span.forced_text}' in forced
    assert "".join(text for text, _ in chunks) == result.text
    assert result.text.index(span.forced_text) < result.text.index('"sentence"')


def test_evald_down_keeps_the_document_valid(
    tmp_path: Path, llama_backend: Any, smollm2_tokenizer: Any
) -> None:
    from daemon_harness import start_daemon

    handle = start_daemon(tmp_path, CONFIG)
    specs = list_evaluators(handle.target)
    handle.stop()
    with EvaluatorClient(handle.target) as client:
        engine = LocalEngine(
            llama_backend, smollm2_tokenizer, specs, evaluator=client, deadline_ms=1500
        )
        result = engine.generate(PROMPT, json_schema=ESSAY, max_new_tokens=80)
    document = json.loads(result.text)
    assert document["answer"]["$error"] in ("unavailable", "deadline_exceeded")
    assert result.spans[0].error_code == document["answer"]["$error"]


def test_a_refused_schema_is_an_engine_error_naming_the_field(
    llama_backend: Any, smollm2_tokenizer: Any
) -> None:
    from engine_adapter import ReferenceEvaluator, standard_evaluators

    with ReferenceEvaluator(["calc"]) as reference:
        engine = LocalEngine(
            llama_backend, smollm2_tokenizer, standard_evaluators(["calc"]), evaluator=reference
        )
        bad = json.loads(json.dumps(ESSAY))
        bad["properties"]["answer"]["computed"]["by"] = "strop"
        with pytest.raises(EngineError, match="/properties/answer/computed/by: unknown evaluator"):
            engine.generate(PROMPT, json_schema=bad)
        # A plain schema needs no evaluator, and the engine still works after a refusal.
        plain = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        bare = LocalEngine(llama_backend, smollm2_tokenizer, standard_evaluators(["calc"]))
        result = bare.generate(PROMPT, json_schema=plain, max_new_tokens=12)
        assert isinstance(json.loads(result.text)["n"], int)
