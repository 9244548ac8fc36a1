"""Rust and AssemblyScript evaluators end to end: ``evald new --lang rust|assemblyscript`` →
``build`` (the real rustc and asc) → ``test`` → ``register`` on a real daemon → ``call``, with the
ports of checksum beside them; what the guest libraries do with a panic, an out-of-bounds access
and an allocation past the memory cap (the same typed outcome as a Zig guest's); and a clear
message for a missing compiler or an unsupported dependency.

Each template and each misbehaving guest is built once per module (a Rust build takes seconds,
an AssemblyScript one more). Without a compiler the tests that need it skip saying what to
install; in CI they fail instead (``toolchains.require_toolchain``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import TOKENS, Daemon, start_daemon, tenant_block
from sdk_cli import Run, cli, roman
from toolchains import require_toolchain

import evald.sdk as sdk
from evald.cli import main
from evald.contract import GUEST_ERROR_CODES
from evald.host import HostConfig, Limits
from evald.sdk import _assemblyscript
from evaluators_wasm import PORTS, PORTS_DIR

TENANT = "beta"
LANGUAGES = {"rust": "roman_rs", "assemblyscript": "roman_as"}
ROOT = Path(__file__).resolve().parents[3]




@pytest.fixture(scope="module", params=list(LANGUAGES))
def language(request: pytest.FixtureRequest) -> str:
    require_toolchain(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def template(language: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = LANGUAGES[language]
    folder = tmp_path_factory.mktemp(f"sdk-{language}") / name
    made = cli("new", name, "--lang", language, "--dir", folder)
    assert made.status == 0, made.err
    return folder


@pytest.fixture(scope="module")
def template_build(template: Path) -> Run:
    return cli("build", template, "--no-grammar-check")


# --- evald new ------------------------------------------------------------------------------


def test_new_writes_a_project_a_rust_or_typescript_developer_knows(
    language: str, template: Path
) -> None:
    name = LANGUAGES[language]
    files = sorted(p.relative_to(template).as_posix() for p in template.rglob("*") if p.is_file())
    if language == "rust":
        assert files == ["Cargo.toml", "cases.jsonl", "grammar.ebnf", "manifest.json",
                         "src/lib.rs"]  # fmt: skip
        package = (template / "Cargo.toml").read_text()
        assert f'name = "{name}"' in package and 'panic = "abort"' in package
        assert f'evald-guest = {{ path = "{sdk.GUEST_CRATE.as_posix()}" }}' in package
        assert (sdk.GUEST_CRATE / "src" / "lib.rs").is_file()
    else:
        assert files == ["assembly/index.ts", "assembly/tsconfig.json", "cases.jsonl",
                         "grammar.ebnf", "manifest.json", "package.json"]  # fmt: skip
        package = json.loads((template / "package.json").read_text())
        assert package["name"] == name
        assert package["devDependencies"]["assemblyscript"] == sdk.ASC_VERSION
        guest = package["devDependencies"]["evald-guest"].removeprefix("file:")
        assert Path(guest) == sdk.GUEST_PACKAGES / "evald-guest" and Path(guest, "abi.ts").is_file()
    manifest = json.loads((template / "manifest.json").read_text())
    assert (manifest["name"], manifest["tag"]) == (name, name)
    # The ABI comes from the guest library, not from code copied into the template.
    source = (template / sdk.LANGUAGES[language]).read_text()
    assert "evald_input_ptr" not in source and "evald-guest" in source.replace("_", "-")
    assert "NAME" not in package and "EVALD_GUEST" not in str(package)


def test_the_cli_offers_every_sdk_language(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["new", "x", "--lang", "cobol"])
    offered = ", ".join(repr(language) for language in sdk.LANGUAGES)
    assert f"(choose from {offered})" in capsys.readouterr().err


# --- evald build and evald test -------------------------------------------------------------


def test_each_template_builds_as_it_is_and_passes_its_cases(
    language: str, template: Path, template_build: Run
) -> None:
    name = LANGUAGES[language]
    assert template_build.status == 0, template_build.err
    assert template_build.err == ""  # no warning: the pinned compiler, a clean grammar
    assert f"built {name} 0.1.0 -> {template.resolve() / (name + '.wasm')}" in template_build.out
    compiler = "rustc " + sdk.RUST_VERSION if language == "rust" else "asc " + sdk.ASC_VERSION
    assert compiler in template_build.out
    assert "checked as the daemon will: ABI v1 exports, no imports" in template_build.out
    run = cli("test", template / f"{name}.wasm", template / "cases.jsonl", "--json")
    assert run.status == 0, run.out + run.err
    rows = [json.loads(line) for line in run.out.splitlines() if line.startswith("{")]
    cases = sdk.load_cases(template / "cases.jsonl")
    assert len(rows) == len(cases) == 8
    for row, case in zip(rows, cases, strict=True):
        assert row["passed"], row
        assert (row["value"], row["error"]) == (case.value, case.error)
        if case.value is not None:
            assert case.value == roman(int(case.input))


def test_a_compile_error_shows_the_compilers_own_output(
    language: str, template: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil_copy(template, broken)
    source = broken / sdk.LANGUAGES[language]
    text = source.read_text()
    source.write_text(text.replace('"no leading zeros"', '"no leading zeros" +', 1))
    run = cli("build", broken, "--no-grammar-check")
    assert run.status == 2
    if language == "rust":
        assert re.search(r"error.*\n.*--> src/lib\.rs:\d+:\d+", run.err), run.err
    else:
        assert "ERROR TS" in run.err and "assembly/index.ts" in run.err, run.err
    assert run.err.rstrip().endswith(
        f"error: invalid_module: compiling {sdk.LANGUAGES[language]} failed "
        "(compiler output above)"
    )
    assert not list(broken.glob("*.wasm"))


def shutil_copy(source: Path, target: Path) -> None:
    import shutil

    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.wasm"))


def test_a_missing_compiler_is_named_with_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for language in LANGUAGES:
        folder = tmp_path / language
        assert cli("new", "nocompiler", "--lang", language, "--dir", folder).status == 0
    monkeypatch.setenv("EVALD_RUSTC", str(tmp_path / "no-rustc"))
    run = cli("build", tmp_path / "rust", "--no-grammar-check")
    assert run.status == 2
    assert run.err.startswith(
        "error: invalid_argument: no Rust compiler for wasm32-unknown-unknown was found (tried "
        f"$EVALD_RUSTC={tmp_path / 'no-rustc'}: {tmp_path / 'no-rustc'} (not installed)); "
        "install one: on Debian or Ubuntu `apt-get install --no-install-recommends rustc "
        "libstd-rust-dev-wasm32 lld-14`"
    ), run.err
    assert "rustup target add wasm32-unknown-unknown" in run.err
    monkeypatch.setenv("EVALD_ASC", str(tmp_path / "no-asc"))
    run = cli("build", tmp_path / "assemblyscript", "--no-grammar-check")
    assert run.status == 2
    assert run.err.startswith(
        "error: invalid_argument: the AssemblyScript compiler was not found (tried "
        f"$EVALD_ASC={tmp_path / 'no-asc'}); install it outside any tenant's folder: `npm "
        f"install --ignore-scripts --prefix /opt/evald-asc assemblyscript@{sdk.ASC_VERSION}` "
        "and set $EVALD_ASC=/opt/evald-asc/node_modules/.bin/asc"
    ), run.err
    monkeypatch.delenv("EVALD_ASC")
    monkeypatch.setattr(_assemblyscript, "CHECKOUT_ASC", tmp_path / "no-checkout" / "asc")
    monkeypatch.setenv("PATH", str(tmp_path))  # no asc on PATH either
    run = cli("build", tmp_path / "assemblyscript", "--no-grammar-check")
    assert run.status == 2
    assert f"(tried {tmp_path / 'no-checkout' / 'asc'} and asc on PATH)" in run.err, run.err


def test_a_rustc_without_the_wasm32_library_is_passed_over_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rustup toolchain without the target (as on CI's machines) is refused, saying so."""
    rustup = Path.home() / ".cargo" / "bin" / "rustc"
    if not rustup.exists():
        pytest.skip("no rustup toolchain here to pass over")
    assert cli("new", "rustup", "--lang", "rust", "--dir", tmp_path / "r").status == 0
    monkeypatch.setenv("EVALD_RUSTC", str(rustup))
    run = cli("build", tmp_path / "r", "--no-grammar-check")
    if run.status == 0:
        pytest.skip("this rustup toolchain has the wasm32 target")
    assert run.status == 2, run.err
    assert f"{rustup} (rustc " in run.err
    assert "no wasm32-unknown-unknown standard library)" in run.err, run.err


def test_a_cargo_dependency_is_refused_before_compiling(tmp_path: Path) -> None:
    folder = tmp_path / "deps"
    assert cli("new", "deps", "--lang", "rust", "--dir", folder).status == 0
    cargo = folder / "Cargo.toml"
    cargo.write_text(cargo.read_text().replace("[dependencies]\n", '[dependencies]\nserde = "1"\n'))
    run = cli("build", folder, "--no-grammar-check")
    assert run.status == 2
    assert "depends on serde; `evald build` links only the evald-guest crate" in run.err


def test_the_guest_libraries_know_exactly_the_guest_error_codes() -> None:
    rust = (sdk.GUEST_CRATE / "src" / "lib.rs").read_text()
    assemblyscript = (sdk.GUEST_PACKAGES / "evald-guest" / "index.ts").read_text()
    codes = {code.value for code in GUEST_ERROR_CODES}
    assert set(re.findall(r'Code::\w+ => "(\w+)"', rust)) == codes
    assert set(re.findall(r'return "(\w+)";', assemblyscript)) == codes


# --- what a guest may not do ----------------------------------------------------------------

MISBEHAVING = {
    "zig": ("main.zig", """
const std = @import("std");
var input_buf: [64]u8 = undefined;
var output_buf: [16]u8 = undefined;
export fn evald_abi_version() i32 { return 1; }
export fn evald_input_ptr() i32 { return @intCast(@intFromPtr(&input_buf)); }
export fn evald_input_cap() i32 { return input_buf.len; }
export fn evald_output_ptr() i32 { return @intCast(@intFromPtr(&output_buf)); }
export fn evald_output_cap() i32 { return output_buf.len; }
fn put(text: []const u8) i32 { @memcpy(output_buf[0..text.len], text); return @intCast(text.len); }
export fn evald_eval(len: i32) i32 {
    const input = input_buf[0..@intCast(len)];
    if (std.mem.eql(u8, input, "ok")) return put("ok");
    if (std.mem.eql(u8, input, "panic")) @panic("the guest gave up");
    if (std.mem.eql(u8, input, "oob")) {
        const far: *volatile u8 = @ptrFromInt(0xFFFFFFF0);
        return far.*;
    }
    if (std.mem.eql(u8, input, "alloc")) {
        const big = std.heap.wasm_allocator.alloc(u8, 100 << 20) catch @trap();
        const last: *volatile u8 = &big[big.len - 1];
        last.* = 1;
        return put("ok");
    }
    return -put("syntax");
}
"""),
    "rust": ("src/lib.rs", """
use evald_guest::{evaluator, Error, Result};
evaluator!(misbehave, input_capacity = 64, output_capacity = 16);
fn touch(v: &[u8]) -> u8 { unsafe { core::ptr::read_volatile(&v[v.len() - 1]) } }
fn misbehave(input: &str) -> Result<String> {
    match input {
        "ok" => Ok("ok".into()),
        "panic" => panic!("the guest gave up"),
        "oob" => Ok(unsafe { core::ptr::read_volatile(0xFFFF_FFF0usize as *const u8) }.to_string()),
        "alloc" => Ok(touch(&vec![1u8; 100 << 20]).to_string()),
        "churn" => Ok((touch(&vec![7u8; 1 << 20]) - 6).to_string()),
        "kept" => Ok("top,level".into()),
        "long" => Ok("x".repeat(17)),
        "long_error" => Err(Error::syntax("\\u{e9}".repeat(20))),
        _ => Err(Error::syntax("unknown behaviour")),
    }
}
"""),
    "assemblyscript": ("assembly/index.ts", """
import { Code, evaluator, fail } from "evald-guest";
export * from "evald-guest/abi";
// allocated by the top level, so kept by every call's rewind of the heap
const kept = new Array<string>(0);
kept.push("top");
kept.push("level");
evaluator(misbehave, 64, 16);
function misbehave(input: string): string {
  if (input == "ok") return "ok";
  if (input == "panic") throw new Error("the guest gave up");
  if (input == "oob") return load<u8>(0xfffffff0).toString();
  if (input == "alloc") return new Uint8Array(100 << 20).length.toString();
  if (input == "churn") return (new Uint8Array(1 << 20)).fill(1)[7].toString();
  if (input == "kept") return kept.join(",");
  if (input == "long") return "x".repeat(17);
  if (input == "long_error") return fail(Code.Syntax, "\\u00e9".repeat(20));
  return fail(Code.Syntax, "unknown behaviour");
}
"""),
}
#: Each behaviour and the typed outcome a Zig guest gets for it from the daemon's host.
TRAPS = {"panic": "guest_fault", "oob": "guest_fault", "alloc": "memory_limit"}


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The misbehaving guest in each language whose compiler is here (Zig always)."""
    built = {}
    for language, (source, text) in MISBEHAVING.items():
        if language != "zig":
            require_toolchain(language)
        folder = tmp_path_factory.mktemp(f"misbehaving-{language}")
        assert cli("new", "misbehaving", "--lang", language, "--dir", folder).status == 0
        (folder / source).write_text(text.lstrip())
        manifest = folder / "manifest.json"
        values = {**json.loads(manifest.read_text()), "result_regex": "[a-z0-9,]+"}
        manifest.write_text(json.dumps(values))
        built[language] = sdk.build_folder(folder, check_grammars=False, write=False).wasm
    return built


def _cases(folder: Path, lines: list[dict[str, str]]) -> list[sdk.Case]:
    path = folder / "cases.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return sdk.load_cases(path)


def test_a_panic_a_stray_access_and_an_allocation_past_the_cap_end_as_for_a_zig_guest(
    misbehaving: dict[str, bytes], tmp_path: Path
) -> None:
    """Under the daemon's host and the default tenant's limits (64 MiB of memory), each
    language's guest ends each behaviour with the code the Zig guest gets, and keeps serving."""
    lines = []
    for behaviour, code in TRAPS.items():
        lines += [{"input": behaviour, "error": code}, {"input": "ok", "value": "ok"}]
    cases = _cases(tmp_path, lines)
    outcomes = {}
    for language, wasm in misbehaving.items():
        results = sdk.run_cases(wasm, cases)
        assert [r.problem for r in results] == [""] * len(cases), (language, results)
        outcomes[language] = [(r.outcome.error, r.outcome.value) for r in results]
        alloc = next(r for r in results if r.case.input == "alloc").outcome
        assert "more than the memory limit of 67108864 bytes" in alloc.message
    assert len(set(map(tuple, outcomes.values()))) == 1, outcomes
    assert set(outcomes) == {"zig", "rust", "assemblyscript"}


def test_each_call_starts_with_an_empty_heap_and_the_top_level_kept(
    misbehaving: dict[str, bytes], tmp_path: Path
) -> None:
    """A megabyte a call, a hundred calls on one reused instance under an 8 MiB cap: the heap
    is rewound at each call (else the twelfth would hit the cap), and what the module's top
    level allocated survives every rewind."""
    churn = [{"input": "churn", "value": "1"}] * 100 + [{"input": "kept", "value": "top,level"}]
    cases = _cases(tmp_path, churn)
    settings = sdk.DaemonSettings(
        host=HostConfig(isolation="reuse"), limits=Limits(memory_bytes=8 << 20), tenant=None,
        source="test",
    )  # fmt: skip
    for language in ("rust", "assemblyscript"):
        results = sdk.run_cases(misbehaving[language], cases, settings)
        assert [r.problem for r in results] == [""] * len(cases), (language, results[-3:])


def test_the_libraries_fit_values_and_errors_to_the_output_buffer(
    misbehaving: dict[str, bytes], tmp_path: Path
) -> None:
    """A value past the 16-byte output buffer is ``too_large`` (its message cut to the six bytes
    after ``too_large:``); an error message is cut to fit at a character boundary (``é`` is two
    bytes: ``syntax:`` and four of them)."""
    cases = _cases(tmp_path, [{"input": "long", "error": "too_large"},
                              {"input": "long_error", "error": "syntax"}])  # fmt: skip
    for language in ("rust", "assemblyscript"):
        long_value, long_error = (r.outcome for r in sdk.run_cases(misbehaving[language], cases))
        assert long_value.message == "the value is longer than the output buffer"[:6], language
        assert long_error.message == "\u00e9" * 4, language


# --- on a real daemon -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = "\n".join([
        "[server]",
        "threads = 2",
        tenant_block("local", token=False, evaluators=["*"], allow_register=True),
        tenant_block(TENANT, evaluators=["calc"], allow_register=True, max_modules=8),
    ])  # fmt: skip
    handle = start_daemon(tmp_path_factory.mktemp("sdk-languages-daemon"), config)
    try:
        yield handle
    finally:
        assert handle.stop() == 0, handle.log_path.read_text()


def on_daemon(daemon: Daemon, *args: str | Path) -> Run:
    command, *rest = args
    return cli(command, "--target", daemon.target, "--token", TOKENS[TENANT], *rest)


def test_templates_and_ports_register_and_answer_on_a_real_daemon(
    language: str, template: Path, template_build: Run, daemon: Daemon
) -> None:
    """The template's built module and the language's port, built by ``evald register`` from
    its folder, register under the tenant; ``evald call`` gets their values."""
    assert template_build.status == 0, template_build.err
    name = LANGUAGES[language]
    (port,) = [p for p, (_, lang) in PORTS.items() if lang == language]
    try:
        run = on_daemon(daemon, "register", template / f"{name}.wasm")
        assert run.status == 0 and f"registered {name} 0.1.0" in run.out, run.err
        run = on_daemon(daemon, "register", PORTS_DIR / port, "--no-grammar-check")
        assert run.status == 0 and f"registered {port} 1.0.0" in run.out, run.err
        listed = {
            json.loads(line)["name"]
            for line in on_daemon(daemon, "evaluators", "--json").out.splitlines()
        }
        assert {name, port} <= listed
        assert on_daemon(daemon, "call", name, "1994").out == "MCMXCIV\n"
        refused = on_daemon(daemon, "call", name, "4000")
        assert (refused.status, refused.err) == (
            2, "error: domain: Roman numerals cover 1 to 3999\n")
        assert on_daemon(daemon, "call", port, 'crc32("hello")').out == "3610a686\n"
        called = on_daemon(daemon, "call", port, 'isbn13_valid("978-0-306-40615-7")')
        assert called.out == "true\n", called.err
    finally:
        on_daemon(daemon, "unregister", name)
        on_daemon(daemon, "unregister", port)


# --- the docs -------------------------------------------------------------------------------


def test_the_guide_quotes_the_measured_languages_table() -> None:
    """docs/writing-evaluators.md shows the table `evald bench host --table` last wrote."""
    guide = (ROOT / "docs" / "writing-evaluators.md").read_text()
    table = (ROOT / "reports" / "bench" / "languages.md").read_text()
    quoted = guide.split("<!-- languages:begin -->\n", 1)[1].split("<!-- languages:end -->", 1)[0]
    assert quoted == table
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == [
        "| Zig", "| Rust", "| AssemblyScript"]
