"""The evaluator SDK end to end: ``evald new`` → ``build`` → ``test`` → ``register`` on a real
daemon → ``evaluators`` / ``call`` → the engine adapter's grammar from ``ListEvaluators`` on
SmolLM2's real tokenizer and XGrammar's real matcher, with the result forced through the daemon;
and a clear refusal for each way a tenant can get it wrong.

Zig builds cost seconds cold, so the template is built once per language for the module, and
each failure case is one small edit of a copy (the unchanged parts come from Zig's cache).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import TOKENS, Daemon, padded, start_daemon, tenant_block
from sdk_cli import Run, cli, roman

import evald.sdk._sdk as sdk

CAP_BYTES = 64 * 1024
NAME = "mytag"
TENANT = "beta"


def on_daemon(daemon: Daemon, *args: str | Path) -> Run:
    command, *rest = args
    return cli(command, "--target", daemon.target, "--token", TOKENS[TENANT], *rest)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def zig_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sdk") / NAME
    made = cli("new", NAME, "--dir", folder)
    assert made.status == 0, made.err
    return folder


@pytest.fixture(scope="module")
def zig_build(zig_folder: Path) -> Run:
    """The one full build of the Zig template (XGrammar check included where installed)."""
    return cli("build", zig_folder)


@pytest.fixture(scope="module")
def zig_wasm(zig_folder: Path, zig_build: Run) -> bytes:
    assert zig_build.status == 0, zig_build.err
    return (zig_folder / f"{NAME}.wasm").read_bytes()


@pytest.fixture(scope="module")
def c_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sdk-c") / "mytag_c"
    assert cli("new", "mytag_c", "--lang", "c", "--dir", folder).status == 0
    return folder


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon of its own: the tenant registers and deletes modules, and the cap is small."""
    config = "\n".join(
        [
            "[server]",
            "threads = 2",
            "[host]",
            f"module_bytes = {CAP_BYTES}",
            tenant_block("local", token=False, evaluators=["*"], allow_register=True),
            tenant_block(TENANT, evaluators=["calc"], allow_register=True, max_modules=8),
        ]
    )
    handle = start_daemon(tmp_path_factory.mktemp("sdk-daemon"), config)
    try:
        yield handle
    finally:
        assert handle.stop() == 0, handle.log_path.read_text()


def variant(folder: Path, tmp_path: Path, name: str = "variant") -> Path:
    """A copy of a template folder to break in one way."""
    copy = tmp_path / name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.wasm"))
    return copy


def edit_manifest(folder: Path, **fields: str) -> None:
    path = folder / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# --- evald new ------------------------------------------------------------------------------


def test_new_writes_the_template_with_the_name(zig_folder: Path, c_folder: Path) -> None:
    assert sorted(p.name for p in zig_folder.iterdir() if p.suffix != ".wasm") == [
        "cases.jsonl",
        "grammar.ebnf",
        "main.zig",
        "manifest.json",
    ]
    assert (c_folder / "main.c").read_bytes() == (sdk.TEMPLATE_DIR / "main.c").read_bytes()
    manifest = json.loads((zig_folder / "manifest.json").read_text())
    assert (manifest["name"], manifest["tag"], manifest["semantics_version"]) == (
        NAME,
        NAME,
        f"{NAME}/1",
    )
    assert "NAME" not in (zig_folder / "manifest.json").read_text()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("calc", "the name 'calc' is reserved for the standard evaluators"),
        ("Roman-1", "must match [a-z][a-z0-9_]{0,31}"),
        ("x" * 33, "must match"),
    ],
)
def test_new_refuses_names_registration_would_refuse(
    tmp_path: Path, name: str, message: str
) -> None:
    run = cli("new", name, "--dir", tmp_path / "x")
    assert run.status == 2
    assert run.err.startswith("error: invalid_argument: ") and message in run.err
    assert not (tmp_path / "x").exists()


def test_new_never_writes_into_a_folder_that_has_files(tmp_path: Path) -> None:
    (tmp_path / "main.zig").write_text("mine")
    run = cli("new", "other", "--dir", tmp_path)
    assert run.status == 2 and "not an empty folder" in run.err
    assert (tmp_path / "main.zig").read_text() == "mine"


# --- evald build ----------------------------------------------------------------------------


def test_build_writes_the_module_and_says_what_it_checked(
    zig_folder: Path, zig_build: Run, zig_wasm: bytes
) -> None:
    sha = hashlib.sha256(zig_wasm).hexdigest()
    assert f"built {NAME} 0.1.0 -> {zig_folder.resolve() / (NAME + '.wasm')}" in zig_build.out
    assert f"sha256 {sha[:12]}" in zig_build.out
    assert "checked as the daemon will" in zig_build.out and "tenant local" in zig_build.out
    assert f"span <{NAME}>...</{NAME}>" in zig_build.out
    if xgrammar_available():
        assert "input grammar and result regex compile with XGrammar" in zig_build.out
    assert zig_build.err == ""  # no warnings for the template


def test_builds_are_byte_identical_across_folders(
    zig_folder: Path, zig_wasm: bytes, tmp_path: Path
) -> None:
    elsewhere = variant(zig_folder, tmp_path, "deeper")
    rebuilt = sdk.build_folder(elsewhere, check_grammars=False, write=False)
    assert rebuilt.wasm == zig_wasm
    assert rebuilt.manifest.name == NAME and rebuilt.path is None


def test_build_failure_shows_the_compiler_output(zig_folder: Path, tmp_path: Path) -> None:
    broken = variant(zig_folder, tmp_path)
    source = broken / "main.zig"
    source.write_text(source.read_text().replace("return 1;", "return 1 +;", 1))
    run = cli("build", broken, "--no-grammar-check")
    assert run.status == 2
    assert re.search(r"main\.zig:\d+:\d+: error: expected expression", run.err), run.err
    assert "return 1 +;" in run.err  # the offending line, as the compiler quotes it
    assert run.err.rstrip().endswith(
        "error: invalid_module: compiling main.zig failed (compiler output above)"
    )
    assert not (broken / f"{NAME}.wasm").exists()


def test_a_module_that_imports_something_is_refused(zig_folder: Path, tmp_path: Path) -> None:
    importing = variant(zig_folder, tmp_path)
    source = importing / "main.zig"
    text = source.read_text()
    text = text.replace(
        "const input_capacity", 'extern "env" fn clock_ms() u32;\n\nconst input_capacity', 1
    )
    text = text.replace("if (number > 3999)", "if (number > 3999 + clock_ms())", 1)
    source.write_text(text)
    run = cli("build", importing, "--no-grammar-check")
    assert run.status == 2
    assert run.err.startswith("error: invalid_module: the module imports env.clock_ms (func)")
    assert "may import nothing" in run.err


@pytest.mark.skipif(not xgrammar_available(), reason="XGrammar is not installed")
@pytest.mark.parametrize(
    ("field", "text", "reason"),
    [
        ("grammar", "root ::= [1-9] digit?\n", 'Rule "digit" is not defined'),
        ("grammar", "root ::= [1-9] (\n", "EBNF parser error"),
        ("regex", "M{0,3}(CM|CD", "parenthesis is not closed"),
    ],
)
def test_a_grammar_xgrammar_cannot_compile_is_refused(
    zig_folder: Path, tmp_path: Path, field: str, text: str, reason: str
) -> None:
    bad = variant(zig_folder, tmp_path)
    if field == "grammar":
        (bad / "grammar.ebnf").write_text(text)
    else:
        edit_manifest(bad, result_regex=text)
    run = cli("build", bad)
    label = "input_grammar" if field == "grammar" else "result_regex"
    assert run.status == 2
    assert run.err.startswith(
        f"error: invalid_module: manifest field {label} does not compile with XGrammar: "
    )
    assert reason in run.err and ".cc:" not in run.err  # the reason, not XGrammar's C++ file


def test_a_standard_name_is_refused_at_build(zig_folder: Path, tmp_path: Path) -> None:
    clash = variant(zig_folder, tmp_path)
    edit_manifest(clash, tag="calc")
    run = cli("build", clash, "--no-grammar-check")
    assert run.status == 2
    assert "error: invalid_argument: the tag 'calc' is reserved" in run.err


def test_build_applies_the_configured_module_cap(
    zig_folder: Path, zig_wasm: bytes, tmp_path: Path
) -> None:
    config = tmp_path / "evald.toml"
    config.write_text(f"[host]\nmodule_bytes = {len(zig_wasm) - 1}\n")
    run = cli("build", zig_folder, "--no-grammar-check", "--config", config, "-o", tmp_path / "o")
    assert run.status == 2
    assert f"the module is {len(zig_wasm)} bytes; the module size cap is {len(zig_wasm) - 1}" in (
        run.err
    )
    config.write_text(f"[host]\nmodule_bytes = {len(zig_wasm)}\n")
    run = cli("build", zig_folder, "--no-grammar-check", "--config", config, "-o", tmp_path / "o")
    assert run.status == 0, run.err
    assert (tmp_path / "o").read_bytes() == zig_wasm


def test_build_refuses_what_the_daemon_refuses_and_warns_about_the_rest(
    zig_folder: Path, tmp_path: Path
) -> None:
    risky = variant(zig_folder, tmp_path)
    (risky / "grammar.ebnf").write_text('root ::= [1-9] [0-9]? ("" | " °C" | [^"])\n')
    run = cli("build", risky, "--no-grammar-check")
    assert run.status != 0
    assert "input_grammar may produce '<'" in run.err
    (risky / "grammar.ebnf").write_text('root ::= [1-9] [0-9]? ("" | " °C")\n')
    edit_manifest(risky, result_regex="M{0,3}(CM|CD|D?C{0,3})(XC|XL|L?X{0,3})(IX|IV|V?I{0,3}).*")
    run = cli("build", risky, "--no-grammar-check")
    assert run.status != 0
    assert "result_regex may produce '<'" in run.err
    edit_manifest(risky, result_regex="M{0,3}(CM|CD|D?C{0,3})(XC|XL|L?X{0,3})(IX|IV|V?I{0,3})")
    run = cli("build", risky, "--no-grammar-check")
    assert run.status == 0, run.err
    warnings = [line for line in run.err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, run.err
    assert "' °C'" in warnings[0] and "XGrammar 0.2.7" in warnings[0]


def test_the_scan_finds_no_problem_in_the_standard_grammars() -> None:
    from engine_adapter import standard_evaluators
    from evald.contract import Manifest

    for spec in standard_evaluators():
        manifest = Manifest(
            1,
            spec.name,
            "1.0.0",
            spec.tag,
            f"{spec.name}/1",
            "",
            spec.input_grammar,
            spec.result_regex,
        )
        assert sdk.grammar_warnings(manifest) == [], spec.name


# --- evald test -----------------------------------------------------------------------------


def test_template_cases_pass_in_zig_and_c(
    zig_folder: Path, zig_wasm: bytes, c_folder: Path
) -> None:
    for folder in (zig_folder, c_folder):
        run = cli("test", folder, "--json")
        assert run.status == 0, run.out + run.err
        rows = [json.loads(line) for line in run.out.splitlines()]
        cases = sdk.load_cases(folder / "cases.jsonl")
        assert len(rows) == len(cases) == 8
        for row, case in zip(rows, cases, strict=True):
            assert row["passed"] and row["problem"] == ""
            assert (row["value"], row["error"]) == (case.value, case.error)
            assert row["fuel_used"] > 0 and row["elapsed_us"] >= 0
            if case.value is not None:
                assert case.value == roman(int(case.input))


def test_test_prints_a_table_and_fails_on_a_mismatch(
    zig_folder: Path, zig_wasm: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich folds long cells at the default 80
    cases = tmp_path / "cases.jsonl"
    cases.write_text(
        '{"input": "1994", "value": "MCMXCIV"}\n\n'
        '{"input": "5", "value": "IIIII", "note": "wrong on purpose"}\n'
        '{"input": "4000", "error": "syntax"}\n'
    )
    run = cli("test", zig_folder / f"{NAME}.wasm", cases)
    assert run.status == 1, run.err
    assert "MCMXCIV" in run.out and "ok" in run.out
    assert "FAIL expected 'IIIII', got 'V'" in run.out
    assert "FAIL expected error syntax, got error domain" in run.out
    assert "1 passed, 2 failed" in run.out
    assert "tenant local" in run.out and "deadline 100 ms" in run.out


def test_test_flags_a_value_outside_the_result_regex(
    zig_folder: Path, zig_wasm: bytes, tmp_path: Path
) -> None:
    narrow = variant(zig_folder, tmp_path)
    edit_manifest(narrow, result_regex="[IVX]+")
    run = cli("test", narrow, "--json")
    assert run.status == 1
    rows = {row["input"]: row for row in map(json.loads, run.out.splitlines())}
    assert rows["4"]["passed"]
    assert (
        not rows["1994"]["passed"]
        and "does not match the manifest's result_regex" in (rows["1994"]["problem"])
    )


def test_test_runs_under_the_tenant_limits(zig_wasm: bytes, tmp_path: Path) -> None:
    config = tmp_path / "evald.toml"
    config.write_text(
        '[[tenants]]\nname = "tight"\ntoken_sha256 = "' + "0" * 64 + '"\n'
        "[tenants.limits]\nfuel = 600\ninput_bytes = 3\n"
    )
    cases = tmp_path / "cases.jsonl"
    cases.write_text(
        '{"input": "1", "value": "I"}\n'
        '{"input": "3999", "value": "MMMCMXCIX"}\n'
        '{"input": "1994", "value": "MCMXCIV"}\n'
    )
    module = tmp_path / "m.wasm"
    module.write_bytes(zig_wasm)
    run = cli("test", module, cases, "--json", "--config", config, "--tenant", "tight")
    rows = [json.loads(line) for line in run.out.splitlines()]
    assert run.status == 1
    assert [row["error"] for row in rows] == [None, "input_too_large", "input_too_large"]
    run = cli("test", module, cases, "--json", "--config", config, "--tenant", "nobody")
    assert run.status == 2 and "has no tenant 'nobody' (tenants: tight)" in run.err
    config.write_text(config.read_text().replace("input_bytes = 3", "input_bytes = 4"))
    rows = [
        json.loads(line)
        for line in cli(
            "test", module, cases, "--json", "--config", config, "--tenant", "tight"
        ).out.splitlines()
    ]
    assert [row["error"] for row in rows][1:] == ["fuel_exhausted", "fuel_exhausted"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"input": "1"', "cases.jsonl:1: not valid JSON"),
        ('{"input": "1", "value": "I", "error": "syntax"}', 'exactly one of "value" or "error"'),
        ('{"input": "1", "error": "sintax"}', "unknown error code 'sintax' (guest codes: "),
        ('{"input": 1, "value": "I"}', 'a string "input"'),
        ('{"input": "1", "valeu": "I"}', "unknown key(s) valeu"),
    ],
)
def test_a_bad_cases_file_is_refused_with_its_line(
    zig_wasm: bytes, tmp_path: Path, line: str, message: str
) -> None:
    (tmp_path / "cases.jsonl").write_text(line + "\n")
    (tmp_path / "m.wasm").write_bytes(zig_wasm)
    run = cli("test", tmp_path / "m.wasm", tmp_path / "cases.jsonl")
    assert run.status == 2 and run.err.startswith("error: invalid_argument: ")
    assert message in run.err


# --- the whole path through the daemon and the adapter --------------------------------------


def test_register_list_call_and_unregister(
    zig_folder: Path, zig_wasm: bytes, daemon: Daemon
) -> None:
    run = on_daemon(daemon, "register", zig_folder, "--no-grammar-check")
    assert run.status == 0, run.err
    sha = hashlib.sha256(zig_wasm).hexdigest()
    assert f"registered {NAME} 0.1.0 (<{NAME}>, {NAME}/1, sha256 {sha[:12]})" in run.out
    listed = [
        json.loads(line) for line in on_daemon(daemon, "evaluators", "--json").out.splitlines()
    ]
    mine = next(info for info in listed if info["name"] == NAME)
    assert (mine["tag"], mine["version"], mine["owner"], mine["sha256"]) == (
        NAME,
        "0.1.0",
        TENANT,
        sha,
    )
    table = on_daemon(daemon, "evaluators").out
    assert f"<{NAME}>" in table and "0.1.0" in table
    # the console script itself, in a subprocess, as a tenant would run it
    called = daemon.cli("call", NAME, "1994", "--token", TOKENS[TENANT])
    assert (called.returncode, called.stdout) == (0, "MCMXCIV\n"), called.stderr
    refused = on_daemon(daemon, "call", NAME, "4000")
    assert (refused.status, refused.err) == (2, "error: domain: Roman numerals cover 1 to 3999\n")
    # another tenant never sees it
    local = cli("call", "--target", daemon.target, NAME, "1994")
    assert local.status == 2 and local.err.startswith("error: unknown_evaluator")

    assert on_daemon(daemon, "unregister", NAME).status == 0
    gone = on_daemon(daemon, "call", NAME, "1994")
    assert gone.status == 2 and gone.err.startswith("error: unknown_evaluator")
    listed = on_daemon(daemon, "evaluators", "--json").out
    assert f'"name":"{NAME}"' not in listed.replace(" ", "")


def test_registration_refusals_are_clear(
    zig_folder: Path, zig_wasm: bytes, daemon: Daemon, tmp_path: Path
) -> None:
    from evald.sdk import build_evaluator

    module = tmp_path / "m.wasm"
    module.write_bytes(zig_wasm)
    assert on_daemon(daemon, "register", module).status == 0
    try:
        again = on_daemon(daemon, "register", module)
        assert again.status == 2
        assert again.err.startswith(
            f"error: invalid_argument: you already have an evaluator '{NAME}'"
        )
        assert on_daemon(daemon, "register", module, "--replace").status == 0

        # the same tag under another name: clashes with the tenant's own evaluator
        twin = variant(zig_folder, tmp_path, "twin")
        edit_manifest(twin, name="twin", semantics_version="twin/1")
        (tmp_path / "twin.wasm").write_bytes(build_evaluator(twin))
        clash = on_daemon(daemon, "register", tmp_path / "twin.wasm")
        assert clash.status == 2
        assert clash.err.startswith(
            "error: invalid_argument: the manifest's name 'twin' or tag 'mytag' clashes with "
            f"your evaluator '{NAME}'"
        )

        # a standard name, uploaded without `evald build` (which would refuse it)
        edit_manifest(twin, name="strop", tag="twin")
        (tmp_path / "strop.wasm").write_bytes(build_evaluator(twin))
        reserved = on_daemon(daemon, "register", tmp_path / "strop.wasm")
        assert reserved.status == 2
        assert "error: invalid_argument: the name 'strop' is reserved" in reserved.err

        # the daemon's module size cap: n bytes register, n + 1 do not
        (tmp_path / "big.wasm").write_bytes(padded(zig_wasm, CAP_BYTES + 1))
        big = on_daemon(daemon, "register", tmp_path / "big.wasm", "--replace")
        assert big.status == 2
        assert big.err.startswith(
            f"error: invalid_module: the module is {CAP_BYTES + 1} bytes; the module size cap "
            f"is {CAP_BYTES} bytes"
        )
        (tmp_path / "fits.wasm").write_bytes(padded(zig_wasm, CAP_BYTES))
        assert on_daemon(daemon, "register", tmp_path / "fits.wasm", "--replace").status == 0
        assert on_daemon(daemon, "call", NAME, "4").out == "IV\n"  # still serving
    finally:
        on_daemon(daemon, "unregister", NAME)


@functools.cache
def _tokenizer() -> Any:
    from engine_adapter.local import load_tokenizer

    return load_tokenizer()


def test_the_adapter_grammar_picks_up_the_new_tag(
    zig_folder: Path, zig_wasm: bytes, daemon: Daemon
) -> None:
    """No adapter code names ``mytag``: its tag comes from ListEvaluators, and the result the
    daemon computes is forced token by token through XGrammar's matcher."""
    xgr = pytest.importorskip("xgrammar")
    from engine_adapter import (
        EvaluatorClient,
        Injector,
        TokenCodec,
        build_structural_tag,
        list_evaluators,
        special_token_texts,
    )

    assert on_daemon(daemon, "register", zig_folder, "--no-grammar-check").status == 0
    client = EvaluatorClient(daemon.target, TOKENS[TENANT])
    try:
        specs = list_evaluators(daemon.target, TOKENS[TENANT])
        assert {spec.name for spec in specs} == {"calc", NAME}
        tokenizer = _tokenizer()
        grammar = build_structural_tag(specs, special_tokens=special_token_texts(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_structural_tag(grammar.json())
        codec = TokenCodec.from_tokenizer(tokenizer, tokenizer_info=info)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

        def allowed(matcher: Any, token: int) -> bool:
            matcher.fill_next_token_bitmask(bitmask)
            return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

        def feed(matcher: Any, injector: Injector, text: str | list[int]) -> None:
            if isinstance(text, str):
                text = tokenizer.encode(text, add_special_tokens=False)
            for token in text:
                assert allowed(matcher, token), codec.token_bytes(token)
                assert matcher.accept_token(token)
                injector.accept_token(token)

        def force(matcher: Any, injector: Injector) -> bytes:
            forced: list[int] = []
            while injector.pending:
                step = injector.forced_tokens()
                if not step:
                    injector.wait()
                    continue
                feed(matcher, injector, step)
                forced += step
            return codec.decode(forced)

        for number, expected in (
            ("1994", b"<result>MCMXCIV</result>"),
            ("4000", b"<result_error>domain</result_error>"),
        ):
            matcher = xgr.GrammarMatcher(compiled)
            injector = Injector(codec, grammar.bindings, client, deadline_ms=5000)
            feed(matcher, injector, f"In Roman numerals <{NAME}>{number}</{NAME}>")
            assert force(matcher, injector) == expected
            (span,) = injector.spans
            assert (span.evaluator, span.content) == (NAME, number)
            feed(matcher, injector, " indeed.")  # free text resumes after the result

        # inside the span the tag's own grammar rules: no letters, no leading zero
        matcher = xgr.GrammarMatcher(compiled)
        injector = Injector(codec, grammar.bindings, client, deadline_ms=5000)
        feed(matcher, injector, f"<{NAME}>")
        for refused in ("x", "0", "<"):
            (token,) = tokenizer.encode(refused, add_special_tokens=False)
            assert not allowed(matcher, token), refused
    finally:
        client.close()
        on_daemon(daemon, "unregister", NAME)


@pytest.mark.model
def test_the_local_engine_forces_the_new_evaluators_result(
    zig_folder: Path, zig_wasm: bytes, daemon: Daemon
) -> None:
    """The real model writes a number into ``<mytag>``; the engine forces the daemon's answer."""
    pytest.importorskip("xgrammar")
    from engine_adapter import EvaluatorClient, list_evaluators
    from engine_adapter.local import LocalEngine, load_backend

    try:
        import llama_cpp  # noqa: F401

        backend_name = "llama"
    except ImportError:
        backend_name = "hf"
    assert on_daemon(daemon, "register", zig_folder, "--no-grammar-check").status == 0
    backend = load_backend(backend_name, n_ctx=1024)
    client = EvaluatorClient(daemon.target, TOKENS[TENANT])
    try:
        engine = LocalEngine(
            backend,
            _tokenizer(),
            list_evaluators(daemon.target, TOKENS[TENANT]),
            evaluator=client,
            deadline_ms=5000,
        )
        result = engine.generate(
            "What is 1994 in Roman numerals?",
            prefix=f"The number <{NAME}>",
            max_new_tokens=16,
            stop=["</result>", "</result_error>"],
        )
        assert result.spans, result.text
        span = result.spans[0]
        assert span.evaluator == NAME
        assert re.fullmatch(r"[1-9][0-9]{0,3}", span.content), span.content
        number = int(span.content)
        if number <= 3999:
            expected = f"<result>{roman(number)}</result>"
            assert (span.value, span.error_code) == (roman(number), None)
        else:
            expected = "<result_error>domain</result_error>"
            assert span.error_code == "domain"
        assert f"<{NAME}>{span.content}</{NAME}>{expected}" in result.text
    finally:
        client.close()
        backend.close()
        on_daemon(daemon, "unregister", NAME)


# --- the docs -------------------------------------------------------------------------------


def test_a_tenant_evaluator_declaring_literals_gets_the_operands_option(
    zig_folder: Path, daemon: Daemon, tmp_path: Path
) -> None:
    """The option is built from the manifest, not from evaluator names: a tenant's module that
    declares its grammar's literal rule is narrowed like the standard ones, through the
    daemon's ListEvaluators."""
    pytest.importorskip("xgrammar")
    from engine_adapter import build_structural_tag, list_evaluators

    declared = variant(zig_folder, tmp_path, "declared")
    (declared / "grammar.ebnf").write_text("root ::= number\nnumber ::= [1-9] [0-9]{0,3}\n")
    path = declared / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "literals": {"number": "number"}}))
    built = cli("build", declared)
    assert built.status == 0, built.err
    assert on_daemon(daemon, "register", declared / f"{NAME}.wasm").status == 0
    try:
        spec = next(s for s in list_evaluators(daemon.target, TOKENS[TENANT]) if s.name == NAME)
        assert dict(spec.literals) == {"number": "number"}
        grammar = build_structural_tag([spec], operands_from="The year 1994, or was it 12000?")
        assert grammar.operands is not None
        # 12000 is past the rule's four digits: only 1994 (and nothing shorter) is offered
        assert dict(grammar.operands.evaluators[0].literals) == {"number": ("1994",)}
        assert 'number ::= "1994"' in grammar.json().replace("\\", "")
    finally:
        on_daemon(daemon, "unregister", NAME)


def test_build_refuses_literals_the_grammar_does_not_define(
    zig_folder: Path, tmp_path: Path
) -> None:
    bad = variant(zig_folder, tmp_path)
    path = bad / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "literals": {"digits": "number"}}))
    run = cli("build", bad, "--no-grammar-check")
    assert run.status == 2
    assert "manifest literals names the rule 'digits', which input_grammar does not define" in (
        run.err
    )


def test_the_guide_shows_the_template_sources_verbatim() -> None:
    guide = (Path(__file__).resolve().parents[3] / "docs" / "writing-evaluators.md").read_text()
    fences = {"zig": "zig", "c": "c", "rust": "rust", "assemblyscript": "ts"}
    blocks = dict(
        (lang, body) for lang, body in re.findall(r"```(zig|c|rust|ts)\n(.*?)```", guide, re.S)
    )
    for lang in sdk.LANGUAGES:
        source = next(iter(sdk.template_files(lang).values())).read_text()
        assert blocks[fences[lang]] == source, (
            f"docs/writing-evaluators.md's {lang} example is stale")
        assert len(source.splitlines()) < 100
        assert f"({len(source.splitlines())} lines)" in guide
    assert (sdk.TEMPLATE_DIR / "grammar.ebnf").read_text().strip() in guide


def test_the_pinned_zig_matches_the_project_pin() -> None:
    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert pyproject.count(f'"ziglang=={sdk.ZIG_VERSION}"') == 2  # the dev and sdk extras
