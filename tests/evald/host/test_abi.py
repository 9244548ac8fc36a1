"""ABI v1 validation: every rule of docs/abi.md refuses with INVALID_MODULE and says why."""

from __future__ import annotations

import json

import pytest
import wasmtime

from evald.contract import (
    MANIFEST_MAX_BYTES,
    MANIFEST_SECTION,
    ErrorCode,
    EvaldError,
    Manifest,
    append_custom_section,
    parse_manifest,
)
from evald.host import check_manifest_grammars, validate_module
from evald.testing import MANIFEST, guest, manifest_bytes


def refused(wasm: bytes, **kwargs: int) -> str:
    with pytest.raises(EvaldError) as caught:
        validate_module(wasm, **kwargs)
    assert caught.value.code is ErrorCode.INVALID_MODULE
    return caught.value.message


def test_a_conforming_module_passes_and_yields_its_manifest() -> None:
    manifest = validate_module(guest("echo"))
    assert manifest == Manifest(**MANIFEST)
    assert manifest.to_json() == MANIFEST


@pytest.mark.parametrize("data", [b"", b"hello", b"(module)", b"\x7fELF\x02\x01\x01"])
def test_not_wasm(data: bytes) -> None:
    assert "not a WebAssembly module" in refused(data)


def test_truncated_wasm_is_invalid() -> None:
    wasm = guest("echo")
    assert "not valid WebAssembly" in refused(wasm[: len(wasm) // 2])


@pytest.mark.parametrize(
    ("imports", "shown"),
    [
        ('(import "env" "clock" (func $clock (result i64)))', "env.clock (func)"),
        ('(import "env" "seed" (global i32))', "env.seed (global)"),
        (
            '(import "wasi_snapshot_preview1" "fd_write" (func (param i32) (result i32)))',
            "wasi_snapshot_preview1.fd_write (func)",
        ),
    ],
)
def test_any_import_is_refused(imports: str, shown: str) -> None:
    message = refused(guest("echo", imports=imports))
    assert shown in message and "import nothing" in message


@pytest.mark.parametrize(
    "name",
    [
        "memory",
        "evald_abi_version",
        "evald_input_ptr",
        "evald_input_cap",
        "evald_output_ptr",
        "evald_output_cap",
        "evald_eval",
    ],
)
def test_each_required_export_is_required(name: str) -> None:
    extra = "(memory 1)" if name == "memory" else ""
    message = refused(guest("echo", omit=(name,), extra=extra))
    assert f"does not export {name}" in message


@pytest.mark.parametrize(
    ("name", "signature", "shown"),
    [
        ("evald_eval", "(param i64) (result i32)", "(i64) -> (i32)"),
        ("evald_eval", "(param i32)", "(i32) -> ()"),
        ("evald_input_ptr", "(param i32) (result i32)", "(i32) -> (i32)"),
        ("evald_output_cap", "(result i64)", "() -> (i64)"),
    ],
)
def test_a_wrong_export_type_is_refused(name: str, signature: str, shown: str) -> None:
    body_free = {name: signature}
    message = refused(guest("echo", retype=body_free))
    assert f"export {name} has type {shown}" in message


def test_exports_of_the_wrong_kind_are_refused() -> None:
    message = refused(guest("echo", omit=("memory",), extra='(memory 1) (func (export "memory"))'))
    assert "export memory is a func" in message
    message = refused(
        guest(
            "echo", omit=("evald_eval",), extra='(global (export "evald_eval") i32 (i32.const 0))'
        )
    )
    assert "export evald_eval is a global" in message


def test_two_memories_are_refused() -> None:
    # multi-memory is off in the host's engine, so wasmtime already refuses the binary
    assert "not valid WebAssembly" in refused(guest("echo", extra="(memory $second 1)"))


def test_memory_minimum_cap_is_an_n_n_plus_1_pair() -> None:
    wasm = guest("echo", pages=10)
    validate_module(wasm, max_memory_bytes=10 * 65536)
    message = refused(wasm, max_memory_bytes=10 * 65536 - 1)
    assert "declared minimum is 10 pages" in message and "memory cap" in message


def test_module_size_cap_is_an_n_n_plus_1_pair() -> None:
    wasm = guest("echo")
    validate_module(wasm, max_module_bytes=len(wasm))
    message = refused(wasm, max_module_bytes=len(wasm) - 1)
    assert f"the module is {len(wasm)} bytes" in message


def test_host_reserved_export_names_are_refused() -> None:
    message = refused(guest("echo", extra='(global (export "__evald_eval") i32 (i32.const 0))'))
    assert "reserved for the host" in message


def test_manifest_section_missing_or_duplicated() -> None:
    assert f"no {MANIFEST_SECTION} custom section" in refused(guest("echo", manifests=0))
    assert "exactly one is allowed" in refused(guest("echo", manifests=2))


def test_other_custom_sections_are_ignored() -> None:
    wasm = append_custom_section(guest("echo"), "producers", b"\x00")
    assert validate_module(wasm).name == MANIFEST["name"]


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[1, 2]", "must be a JSON object"),
        (manifest_bytes(tag=...), "lacks the field(s) tag"),
        (manifest_bytes(colour="blue"), "unknown field(s) colour"),
        (manifest_bytes(abi=2), "field abi is 2"),
        (manifest_bytes(abi=True), "field abi is True"),
        (manifest_bytes(abi="1"), "field abi is '1'"),
        (manifest_bytes(name="Calc"), "field name is 'Calc'"),
        (manifest_bytes(name="a" * 33), "field name"),
        (manifest_bytes(tag="my-tag"), "field tag is 'my-tag'"),
        (manifest_bytes(version="1.0"), "MAJOR.MINOR.PATCH"),
        (manifest_bytes(version="01.0.0"), "MAJOR.MINOR.PATCH"),
        (manifest_bytes(semantics_version="calc"), "NAME/N"),
        (manifest_bytes(semantics_version="calc/v1"), "NAME/N"),
        (manifest_bytes(description="two\nlines"), "one line"),
        (manifest_bytes(input_grammar='expr ::= "a"'), "root rule"),
        (manifest_bytes(result_regex=""), "must not be empty"),
        (manifest_bytes(description=7), "description must be a string"),
        (manifest_bytes(examples={"input": "1"}), "examples must be a list"),
        (manifest_bytes(examples=[{"input": "1"}] * 9), "at most 8"),
        (manifest_bytes(examples=[{"input": "1"}]), "with input and value"),
        (manifest_bytes(examples=[{"input": "1", "value": "1", "why": "x"}]), "unknown key(s) why"),
        (manifest_bytes(examples=[{"input": "1\n2", "value": "1"}]), "one-line string"),
        (manifest_bytes(examples=[{"input": "1", "value": 1}]), "one-line string"),
        (manifest_bytes(literals=["root"]), "literals must be an object"),
        (manifest_bytes(literals={f"r{i}": "number" for i in range(17)}), "at most 16"),
        (manifest_bytes(literals={"digits": "number"}), "which input_grammar does not define"),
        (manifest_bytes(literals={"root": "date"}), "the literal kinds are number, string"),
        (manifest_bytes(literals={"a b": "number"}), "is not a grammar rule name"),
    ],
)
def test_bad_manifests_name_the_broken_rule(payload: bytes, expected: str) -> None:
    assert expected in refused(guest("echo", manifest=payload))


def test_examples_are_optional_and_round_trip() -> None:
    """``examples`` is the one optional field: absent, it is empty and not written back."""
    plain = parse_manifest(manifest_bytes())
    assert plain.examples == () and "examples" not in plain.to_json()
    examples = [
        {"question": "What is 1 + 1?", "input": "1 + 1", "value": "2"},
        {"input": "2 * 3", "value": "6"},
    ]
    parsed = parse_manifest(manifest_bytes(examples=examples))
    assert [dict(e) for e in parsed.examples] == examples
    assert parsed.to_json()["examples"] == examples
    assert parse_manifest(json.dumps(parsed.to_json()).encode()) == parsed


def test_literals_are_optional_and_round_trip() -> None:
    """``literals`` names rules of the input grammar, each with a kind the adapter knows."""
    plain = parse_manifest(manifest_bytes())
    assert plain.literals == {} and "literals" not in plain.to_json()
    grammar = 'root ::= number (" + " number)*\nnumber ::= [0-9]+\nword ::= [a-z]+'
    declared = {"number": "number", "word": "string"}
    parsed = parse_manifest(manifest_bytes(input_grammar=grammar, literals=declared))
    assert parsed.literals == declared and parsed.to_json()["literals"] == declared
    assert parse_manifest(json.dumps(parsed.to_json()).encode()) == parsed
    # the module carries them: a host load reads the same field
    assert (
        validate_module(
            guest("echo", manifest=manifest_bytes(input_grammar=grammar, literals=declared))
        ).literals
        == declared
    )


def test_manifest_size_cap_is_an_n_n_plus_1_pair() -> None:
    base = manifest_bytes(description="")
    room = MANIFEST_MAX_BYTES - len(base)
    fits = manifest_bytes(description="d" * room)
    assert len(fits) == MANIFEST_MAX_BYTES
    assert parse_manifest(fits).description == "d" * room
    too_big = manifest_bytes(description="d" * (room + 1))
    with pytest.raises(EvaldError, match=f"at most {MANIFEST_MAX_BYTES} bytes"):
        parse_manifest(too_big)


def test_semver_with_prerelease_and_build_is_accepted() -> None:
    assert (
        parse_manifest(manifest_bytes(version="2.1.0-rc.1+build.5")).version == "2.1.0-rc.1+build.5"
    )


def test_validation_needs_no_instantiation() -> None:
    # a start function that never returns is invisible to structural validation (it is refused
    # at load, by the trial instantiation)
    assert validate_module(guest("echo", start="(loop $l (br $l))")).name == "probe"


def test_validation_uses_the_given_engine() -> None:
    config = wasmtime.Config()
    config.wasm_simd = False
    config.wasm_relaxed_simd = False  # (wasmtime aborts on simd off, relaxed simd on)
    engine = wasmtime.Engine(config)
    simd = guest("echo", extra="(func (drop (v128.const i64x2 0 0)))")
    assert validate_module(simd).name == "probe"  # the host's engine allows SIMD
    assert "not valid WebAssembly" in refused(simd, engine=engine)  # type: ignore[arg-type]


def test_xgrammar_check_of_grammar_and_regex() -> None:
    good = parse_manifest(manifest_bytes())
    if not check_manifest_grammars(good):
        pytest.skip("xgrammar is not importable here")
    bad_grammar = parse_manifest(manifest_bytes(input_grammar="root ::= missing_rule"))
    with pytest.raises(EvaldError, match="input_grammar does not compile with XGrammar"):
        check_manifest_grammars(bad_grammar)
    bad_regex = parse_manifest(manifest_bytes(result_regex="(abc"))
    with pytest.raises(EvaldError, match="result_regex does not compile with XGrammar"):
        check_manifest_grammars(bad_regex)
    literal = parse_manifest(
        manifest_bytes(input_grammar="root ::= n\nn ::= [0-9]+", literals={"n": "number"})
    )
    assert check_manifest_grammars(literal)


def test_manifest_json_round_trip() -> None:
    manifest = parse_manifest(manifest_bytes())
    assert parse_manifest(json.dumps(manifest.to_json()).encode()) == manifest
