"""The booking study's one generation step, as an interface: a :class:`JsonRequest` in (system
text, user text, JSON schema, the text the ``extracted`` properties read), a
:class:`JsonReply` out (the JSON text, tokens, wall time, the computed properties' records).

:class:`LocalJsonGenerator` runs it on a :class:`~engine_adapter.LocalEngine`; a client of a
real server (SGLang's ``/generate`` with ``json_schema``, or the OpenAI-compatible
``response_format``) plugs in by implementing :class:`JsonGenerator`, and the runner, the
records and the scoring stay as they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["JsonGenerator", "JsonReply", "JsonRequest", "LocalJsonGenerator"]


@dataclass(frozen=True)
class JsonRequest:
    """One structured-output request."""

    system: str
    prompt: str
    schema: dict[str, Any]
    literals_from: str | None = None
    """The text ``"extracted": true`` properties are narrowed to (``None``: the prompt's)."""
    max_new_tokens: int = 200
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class JsonReply:
    """What one request gave back."""

    text: str
    n_sampled: int
    n_forced: int
    wall_ms: float
    """From the request to the last token, as the caller saw it (prefill included)."""
    stop_reason: str
    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    """The prompt's forward passes (what a prompt cache saves)."""
    computed: list[dict[str, Any]] = field(default_factory=list)
    """One record per computed property: ``field``, ``evaluator``, ``content``, ``value``,
    ``error_code``."""


class JsonGenerator(Protocol):
    """Answers structured-output requests (the local engine, or a server's client)."""

    #: What the study's summary names it by (``llama``, ``sglang``…).
    backend: str

    def generate(self, request: JsonRequest) -> JsonReply: ...


class LocalJsonGenerator:
    """:class:`JsonGenerator` over a :class:`~engine_adapter.LocalEngine`: the request's system
    text becomes the engine's system prompt for the call (restored afterwards)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.backend = str(engine.backend.name)

    def generate(self, request: JsonRequest) -> JsonReply:
        engine = self.engine
        saved = engine.system_prompt
        engine.system_prompt = request.system
        started = time.perf_counter()
        try:
            result = engine.generate(
                request.prompt,
                json_schema=request.schema,
                operands_from=request.literals_from,
                max_new_tokens=request.max_new_tokens,
                temperature=request.temperature,
                seed=request.seed,
            )
        finally:
            engine.system_prompt = saved
        wall_ms = (time.perf_counter() - started) * 1000
        return JsonReply(
            text=result.text,
            n_sampled=result.n_sampled,
            n_forced=result.n_forced,
            wall_ms=wall_ms,
            stop_reason=result.stop_reason,
            prompt_tokens=result.prompt_tokens,
            prefill_ms=result.prefill_us / 1000,
            computed=[_computed_record(span) for span in result.spans],
        )


def _computed_record(span: Any) -> dict[str, Any]:
    return {
        "field": getattr(span, "field", None),
        "evaluator": span.evaluator,
        "content": span.content,
        "value": span.value,
        "error_code": span.error_code,
    }
