"""The two ways an application gets a computed value into an answer, through the OpenAI API with
the ``openai`` client, one answer each: an evaluated span (one streamed request, the value forced
by the server's adapter) and a tool call (a streamed request whose tool call the server's
``tool_choice="required"`` grammar makes the model write, the tool run on the client, a second
streamed request with the tool's answer).

Each returns an :class:`Answer` with the times read on the client's clock (one clock,
``time.perf_counter``), the server's token usage and the final text; nothing here sleeps.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.spans import EvaluatorSpec, span_format
from engine_adapter.testing import spans_in

__all__ = [
    "Answer",
    "Question",
    "ToolRun",
    "fixed_tools",
    "questions",
    "span_answer",
    "span_tag",
    "tool_answer",
    "tools_from",
]

#: A tool's answer when it failed: what the model reads in the tool message.
TOOL_ERROR_PREFIX = "error: "
#: The one parameter of every tool: the text the evaluator reads (what a span holds).
PARAMETER = "expression"


@dataclass(frozen=True)
class Question:
    """A user's question and the expression both paths evaluate for it."""

    text: str
    expression: str


def questions(count: int, *, seed: int = 48) -> list[Question]:
    """``count`` arithmetic questions, each with its own operands (no prompt repeats, so a
    prefix cache helps each path only as far as its requests share a prefix)."""
    import random

    rng = random.Random(seed)
    found: list[Question] = []
    seen: set[str] = set()
    while len(found) < count:
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(101, 999)
        expression = f"{a} * {b} + {c}"
        if expression not in seen:
            seen.add(expression)
            found.append(Question(f"What is {a} times {b}, plus {c}?", expression))
    return found


@dataclass
class Answer:
    """One answer, measured on the client."""

    path: str
    question: Question
    e2e_s: float
    """From sending the question to the end of the last stream."""
    value_in_stream_s: float | None
    """When the value first appeared in the streamed text (None: it never did)."""
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    """Prompt tokens the server served from its prefix cache (None: not reported)."""
    text: str
    """The final turn's text (what the user reads)."""
    value: str | None
    """The evaluator's value the answer must state (None: an error, or nothing evaluated):
    the tool's answer; for a span, evald's value for its content, asked by the benchmark apart
    from the server (``span_answer`` leaves the value the text holds)."""
    expression: str | None
    """What the model had evaluated (the span's content, the tool call's argument)."""
    value_at_client_s: float | None = None
    """Tool path: when the client held the tool's value."""
    between_turns_s: float | None = None
    """Tool path: from the end of the first stream to sending the second request."""
    tool_s: float | None = None
    """Tool path: the tool's own run on the client (part of ``between_turns_s``)."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Usage:
    prompt: int = 0
    completion: int = 0
    cached: int | None = None

    def add(self, usage: Any) -> None:
        if usage is None:
            return
        self.prompt += int(usage.prompt_tokens or 0)
        self.completion += int(usage.completion_tokens or 0)
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        if cached is not None:
            self.cached = (self.cached or 0) + int(cached)


def span_tag(binding: Any, content: str, free: Mapping[str, Any]) -> dict[str, Any]:
    """A structural tag that opens the answer with an evaluated span whose content is
    ``content`` (the model writes each token, the grammar allows only these), then lets the
    model finish under ``free`` (the standard span grammar's free text, its own spans
    allowed)."""
    head = span_format(binding, {"type": "const_string", "value": content})
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [head, free]}}


def tools_from(specs: Iterable[EvaluatorSpec]) -> list[dict[str, Any]]:
    """OpenAI tool definitions for evaluators, from their manifests: the name, the
    description (with the manifest's first example), one string parameter, strict."""
    tools = []
    for spec in specs:
        example = spec.examples[0] if spec.examples else None
        said = f" For example {example.input} gives {example.value}." if example else ""
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": spec.name,
                    "description": spec.description + said,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            PARAMETER: {"type": "string", "description": "the input to evaluate"}
                        },
                        "required": [PARAMETER],
                        "additionalProperties": False,
                    },
                    # Strict: the servers' grammar holds the arguments to this schema (without
                    # it both let the model write any JSON object: tool calling's best case).
                    "strict": True,
                },
            }
        )
    return tools


def fixed_tools(
    tools: Sequence[Mapping[str, Any]], evaluator: str, expression: str
) -> list[dict[str, Any]]:
    """``tools`` with ``evaluator``'s argument fixed to ``expression`` (a JSON schema
    ``const``): the tool call's counterpart of a span whose content the grammar fixes — the
    model writes every token of the call, the servers' strict grammar allows only this
    argument, so both paths evaluate the same expression and compare as mechanisms."""
    fixed = copy.deepcopy([dict(tool) for tool in tools])
    for tool in fixed:
        if tool["function"]["name"] == evaluator:
            properties = tool["function"]["parameters"]["properties"]
            properties[PARAMETER] = {**properties[PARAMETER], "const": expression}
    return fixed


def _stream(client: Any, **request: Any) -> Iterable[Any]:
    return client.chat.completions.create(  # type: ignore[no-any-return]
        stream=True, stream_options={"include_usage": True}, temperature=0, **request
    )


def span_answer(
    client: Any, model: str, question: Question, tag: Mapping[str, Any], max_tokens: int
) -> Answer:
    """One streamed request whose answer opens with the evaluated span (``tag``)."""
    usage = _Usage()
    text = ""
    value_at: float | None = None
    start = time.perf_counter()
    for chunk in _stream(
        client,
        model=model,
        messages=[{"role": "user", "content": question.text}],
        max_tokens=max_tokens,
        extra_body={"response_format": dict(tag)},
    ):
        usage.add(chunk.usage)
        for choice in chunk.choices:
            text += choice.delta.content or ""
        if value_at is None and spans_in(text):
            value_at = time.perf_counter() - start
    end = time.perf_counter() - start
    found = spans_in(text)
    _, content, value, _ = found[0] if found else (None, None, None, None)
    return Answer(
        "span",
        question,
        end,
        value_at,
        1,
        usage.prompt,
        usage.completion,
        usage.cached,
        text,
        value,
        content,
    )


@dataclass(frozen=True)
class ToolRun:
    """How the client runs a tool: ``run(name, expression) -> (value, error)``."""

    name: str
    run: Callable[[str, str], tuple[str | None, str | None]]


def _first_call(chunks: Iterable[Any], usage: _Usage) -> dict[str, str]:
    """The first tool call of a streamed turn, its pieces joined: id, name, arguments."""
    call = {"id": "", "name": "", "arguments": ""}
    for chunk in chunks:
        usage.add(chunk.usage)
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                if (delta.index or 0) != 0:
                    continue
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] = delta.function.name or call["name"]
                    call["arguments"] += delta.function.arguments or ""
    return call


def _expression_of(call: Mapping[str, str]) -> str | None:
    try:
        arguments = json.loads(call["arguments"] or "null")
    except json.JSONDecodeError:
        return None
    found = arguments.get(PARAMETER) if isinstance(arguments, dict) else None
    return found if isinstance(found, str) else None


def tool_answer(
    client: Any,
    model: str,
    question: Question,
    tools: Sequence[Mapping[str, Any]],
    tool: ToolRun,
    max_tokens: int,
) -> Answer:
    """The tool-calling loop an application runs: a streamed turn with ``tool_choice=
    "required"``, the client runs the call, appends the tool message and streams the answer.

    The second turn sends the same tools with ``tool_choice="auto"`` (the default), so its
    prompt opens with the first turn's and the prefix cache can serve it.
    """
    usage = _Usage()
    messages: list[dict[str, Any]] = [{"role": "user", "content": question.text}]
    start = time.perf_counter()
    first = _stream(
        client,
        model=model,
        messages=messages,
        tools=list(tools),
        tool_choice="required",
        max_tokens=max_tokens,
    )
    call = _first_call(first, usage)
    first_end = time.perf_counter()
    expression = _expression_of(call)
    value: str | None = None
    error: str | None = "the call has no expression"
    if expression is not None:
        value, error = tool.run(call["name"], expression)
    tool_end = time.perf_counter()
    answer_text = value if value is not None else f"{TOOL_ERROR_PREFIX}{error}"
    call_id = call["id"] or "call_0"
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": answer_text},
    ]
    text = ""
    value_at: float | None = None
    second_sent = time.perf_counter()
    for chunk in _stream(
        client,
        model=model,
        messages=messages,
        tools=list(tools),
        tool_choice="auto",
        max_tokens=max_tokens,
    ):
        usage.add(chunk.usage)
        for choice in chunk.choices:
            text += choice.delta.content or ""
        if value_at is None and value is not None and _states(text, value):
            value_at = time.perf_counter() - start
    end = time.perf_counter() - start
    return Answer(
        "tool",
        question,
        end,
        value_at,
        2,
        usage.prompt,
        usage.completion,
        usage.cached,
        text,
        value,
        expression,
        value_at_client_s=tool_end - start,
        between_turns_s=second_sent - first_end,
        tool_s=tool_end - first_end,
        extra={"tool_call": call},
    )


def _states(text: str, value: str) -> bool:
    """Whether ``text`` holds ``value`` as a whole number or word (not inside a longer one)."""
    return re.search(rf"(?<![\w.]){re.escape(value)}(?![\w]|\.\d)", text) is not None
