"""``engine-adapter bench vs-tools`` without a server: how a final answer's statement of the
value is classified, the tools described from the manifests, and the chat template the servers
run (SmolLM2's own without tools; the tools, the call and the tool's answer with them), rendered
by transformers as the servers render it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_adapter import standard_evaluators
from evald_lab.bench._vs_tools_paths import Answer, Question, fixed_tools, questions, tools_from
from evald_lab.bench._vs_tools_summary import cell_summary, ratios, stated
from evald_lab.bench.vs_tools import CHAT_TEMPLATE

QUESTION = Question("What is 17 times 23, plus 91?", "17 * 23 + 91")


def answer(path: str, text: str, value: str | None = "482") -> Answer:
    return Answer(
        path,
        QUESTION,
        1.0,
        None,
        1 if path == "span" else 2,
        10,
        5,
        None,
        text,
        value,
        QUESTION.expression,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 482.", "exact"),
        ("17 times 23 plus 91 makes 482", "exact"),
        ("It is 482.0 in total.", "rounded_or_reformatted"),
        ("About 480.", "rounded_or_reformatted"),
        ("The answer is 4820.", "different"),
        ("The answer is 1482.", "different"),
        ("I cannot say.", "missing"),
        ("", "missing"),
    ],
)
def test_a_tool_answer_is_classified_by_how_it_states_the_value(text: str, expected: str) -> None:
    assert stated(answer("tool", text)) == expected


def test_a_span_answer_states_the_value_in_its_result_region() -> None:
    assert stated(answer("span", "<calc>17 * 23 + 91</calc><result>482</result> done")) == "exact"
    assert stated(answer("span", "<calc>1 + 1</calc><result>2</result>")) == "different"
    assert stated(answer("tool", "anything", value=None)) == "no_value"


def test_cells_and_ratios() -> None:
    span = [answer("span", "<calc>17 * 23 + 91</calc><result>482</result>")] * 2
    tool = [answer("tool", "It is 482.")] * 2
    cells = {
        "span": {"1": cell_summary(span, 2.0), "8": cell_summary(span, 1.0)},
        "tool": {"1": cell_summary(tool, 4.0), "8": cell_summary(tool, 4.0)},
    }
    assert cells["span"]["1"]["stated"]["exact"] == 2
    assert cells["tool"]["1"]["requests_per_answer"] == 2
    assert cells["span"]["8"]["answers_per_s"] == 2.0
    found = ratios(cells)
    assert found["time_per_answer_span_over_tool"] == 1.0  # every answer took 1 s here
    assert found["answers_per_s_span_over_tool"] == 4.0 and found["answers_per_s_met"]
    assert found["at_concurrency"] == 1 and found["answers_per_s_at_concurrency"] == 8


def test_questions_do_not_repeat() -> None:
    asked = questions(200)
    assert len({q.expression for q in asked}) == 200
    assert all(q.expression.split()[0] in q.text for q in asked)


def test_tools_come_from_the_manifests() -> None:
    specs = standard_evaluators(["calc", "strop"])
    tools = tools_from(specs)
    assert [t["function"]["name"] for t in tools] == ["calc", "strop"]
    calc = tools[0]["function"]
    assert calc["description"].startswith(specs[0].description)
    assert calc["parameters"]["required"] == ["expression"]


def test_the_tool_argument_is_fixed_like_the_span_content() -> None:
    tools = tools_from(standard_evaluators(["calc", "strop"]))
    fixed = fixed_tools(tools, "calc", "17 * 23 + 91")
    calc, strop = (t["function"]["parameters"]["properties"]["expression"] for t in fixed)
    assert calc == {**calc, "type": "string", "const": "17 * 23 + 91"}
    assert "const" not in strop
    assert all(t["function"]["strict"] for t in fixed)  # the servers hold the call to it
    assert "const" not in tools[0]["function"]["parameters"]["properties"]["expression"]


def _render(tokenizer: Any, messages: list[dict[str, Any]], **more: Any) -> str:
    return str(
        tokenizer.apply_chat_template(
            messages,
            chat_template=CHAT_TEMPLATE.read_text(),
            tokenize=False,
            add_generation_prompt=True,
            **more,
        )
    )


def test_the_chat_template_is_smollm2s_own_without_tools() -> None:
    from engine_adapter.local import load_tokenizer

    tokenizer = load_tokenizer()
    for messages in (
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ):
        own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert _render(tokenizer, messages) == own


def test_the_chat_template_renders_tools_a_call_and_its_answer() -> None:
    from engine_adapter.local import load_tokenizer

    tools = tools_from(standard_evaluators(["calc"]))
    arguments = json.dumps({"expression": "17 * 23 + 91"})
    messages = [
        {"role": "user", "content": QUESTION.text},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "calc", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "482"},
    ]
    text = _render(load_tokenizer(), messages, tools=tools)
    assert '"name": "calc"' in text.split("<tools>\n")[1].split("</tools>")[0]
    call = f'<tool_call>\n{{"name": "calc", "arguments": {arguments}}}\n</tool_call><|im_end|>'
    assert f"<|im_start|>assistant\n{call}" in text
    answer = "<|im_start|>user\n<tool_response>\n482\n</tool_response><|im_end|>\n"
    assert text.endswith(answer + "<|im_start|>assistant\n")
    # The first turn's prompt is a prefix of the second's: the prefix cache can serve it.
    first = _render(load_tokenizer(), messages[:1], tools=tools)
    assert text.startswith(first)
