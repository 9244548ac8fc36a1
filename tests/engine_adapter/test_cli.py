"""``engine-adapter``: the console script's contract (answer on stdout, diagnostics on stderr,
exit 2 with an actionable message on bad input) and ``generate`` end to end against the real
daemon."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.cli import main

ENGINE_ADAPTER = str(Path(sys.executable).with_name("engine-adapter"))
PROMPT = "A box has 17 rows of 23 items, then 91 more are added. How many items are in the box?"
PREFIX = "The expression is <calc>"


def test_console_script_help_names_the_contract() -> None:
    done = subprocess.run(
        [ENGINE_ADAPTER, "generate", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for option in (
        "--evald",
        "--token",
        "--mode",
        "--prefix",
        "--max-new-tokens",
        "--backend",
        "--evaluator-mode",
        "--seed",
    ):
        assert option in done.stdout
    for mode in ("no-grammar", "grammar-no-eval", "grammar-eval"):
        assert mode in done.stdout


def test_top_level_help_lists_the_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--max-new-tokens", "-1", "hi"], "--max-new-tokens must be >= 0"),
        (["generate", "--deadline-ms", "0", "hi"], "--deadline-ms must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err


def test_unknown_mode_is_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--mode", "loud", "hi"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from daemon_harness import start_daemon

    handle = start_daemon(
        tmp_path_factory.mktemp("evald"),
        '[server]\nthreads = 1\n[[tenants]]\nname = "local"\nevaluators = ["*"]\n',
    )
    try:
        yield handle
    finally:
        handle.stop()


@pytest.mark.model
def test_generate_prints_the_answer_with_evalds_result(
    daemon: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from evald.client import Client

    report = tmp_path / "result.json"
    status = main(
        [
            "generate",
            "--evald",
            daemon.target,
            "--prefix",
            PREFIX,
            "--max-new-tokens",
            "20",
            "--timings",
            "--json",
            str(report),
            PROMPT,
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    text = captured.out.rstrip("\n")
    assert text.startswith(PREFIX)
    match = re.search(r"<calc>(.*?)</calc><result>(.*?)</result>", text)
    assert match, text
    with Client(daemon.target) as client:
        assert client.evaluate("calc", match.group(1)).value == match.group(2)
    assert "span <calc>" in captured.err and "tok/s" in captured.err
    saved = json.loads(report.read_text())
    assert saved["text"] == text
    assert saved["spans"][0]["content"] == match.group(1)
    assert saved["steps"][0]["kind"] == "prefill"


@pytest.mark.model
def test_generate_with_instructions_shows_the_text_the_model_was_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from engine_adapter import render_instructions, standard_evaluators

    status = main(["generate", "--evaluator-mode", "python", "--evaluators", "calc",
                   "--instructions", "--timings", "--prefix", "<calc>",
                   "--max-new-tokens", "12", PROMPT])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    expected = render_instructions(standard_evaluators(["calc"]))
    assert f"instructions:\n{expected}\n" in captured.err
    assert captured.out.startswith("<calc>")


@pytest.mark.model
def test_generate_with_operands_narrows_to_the_prompt_and_notes_when_it_cannot(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["generate", "--evaluator-mode", "python", "--evaluators", "calc,strop",
            "--prefix", "<calc>", "--max-new-tokens", "16", "--timings"]
    assert main([*args, "--operands", PROMPT]) == 0
    captured = capsys.readouterr()
    assert "operands:\n  calc: number in {17, 23, 91}" in captured.err
    content = re.search(r"<calc>(.*?)</calc>", captured.out)
    assert content and set(re.findall(r"[0-9]+", content.group(1))) <= {"17", "23", "91"}
    assert main([*args, "--operands-from", "Only 4 and 5.", PROMPT]) == 0
    assert "calc: number in {4, 5}" in capsys.readouterr().err
    assert main([*args, "--operands", "How many r's are in strawberry?"]) == 0
    err = capsys.readouterr().err
    assert "note: operands off for calc: the text holds no literal its grammar accepts" in err
    assert "note: operands off for strop" not in err  # strop took the prompt's words


@pytest.mark.model
def test_generate_refuses_an_evaluator_evald_does_not_offer(
    daemon: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["generate", "--evald", daemon.target, "--evaluators", "calc,nope", "hi"])
    assert status == 2
    err = capsys.readouterr().err
    assert "nope" in err and "offered" in err


@pytest.mark.model
def test_generate_without_a_daemon_warns_and_still_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        [
            "generate",
            "--evald",
            f"unix:{tmp_path / 'nobody-listens.sock'}",
            "--prefix",
            PREFIX,
            "--max-new-tokens",
            "24",
            "--deadline-ms",
            "500",
            PROMPT,
        ]
    )
    captured = capsys.readouterr()
    assert status == 0
    assert "warning: evald at" in captured.err
    assert "<result_error>unavailable</result_error>" in captured.out


@pytest.mark.model
def test_no_grammar_mode_with_the_python_evaluators(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "generate",
            "--evaluator-mode",
            "python",
            "--mode",
            "no-grammar",
            "--max-new-tokens",
            "6",
            "--seed",
            "3",
            "What is 2 + 2?",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.strip() and "<result>" not in captured.out


@pytest.mark.model
def test_generate_with_a_json_schema_prints_the_document_with_its_computed_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "pattern": "^[0-9]{1,3}( [*+] [0-9]{1,3}){1,2}$"},
            "answer": {"type": "integer", "computed": {"by": "calc", "from": "/expression"}},
        },
        "required": ["expression", "answer"],
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    args = ["generate", "--evaluator-mode", "python", "--evaluators", "calc",
            "--max-new-tokens", "40", "--timings", "--json-schema", str(path), PROMPT]  # fmt: skip
    assert main(args) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    from evaluators_wasm.reference import reference

    assert document["answer"] == int(reference("calc")(document["expression"].encode()))
    assert f"/answer = calc({document['expression']!r}) -> {document['answer']}" in captured.err
    path.write_text("{not json")
    assert main(args) == 2
    assert "--json-schema" in capsys.readouterr().err
