"""``evald new --template policy`` in every SDK language, and ``evald test``'s policy
conformance check.

Each language's policy template is written, built by the real compiler and tested as it is:
its cases pass and so does the conformance check (its examples validate against
``input_schema``, its values against ``result_schema``, malformed JSON gives ``syntax``). Then
the check is shown each way a policy can break its manifest's promise, naming the example's
index: a wrong example value, an example input outside ``input_schema``, values outside
``result_schema``, a module that answers malformed JSON with a value or a trap, schemas
without examples. The broken manifests are embedded into the Zig template's compiled code, so
one compile serves them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sdk_cli import cli
from toolchains import require_toolchain, use_repository_asc

from evald.sdk import check_policy, compile_folder
from evald.sdk._toolchain import with_manifest
from evald.testing import guest, manifest_bytes

LANGUAGES = ("zig", "c", "rust", "assemblyscript")
EXAMPLE = {"age": 34, "components": [6500, 1200]}
RESULT = {"total": 7700, "action": "book_appointment", "reason": "eligible"}


@pytest.fixture(scope="module", params=LANGUAGES)
def policy_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    language = str(request.param)
    if language in ("rust", "assemblyscript"):
        use_repository_asc()
        require_toolchain(language)
    folder = tmp_path_factory.mktemp(f"policy-{language}") / f"policy_{language[:4]}"
    made = cli("new", folder.name, "--lang", language, "--template", "policy", "--dir", folder)
    assert made.status == 0, made.err
    assert f"({language}, policy)" in made.out
    return folder


def test_the_template_declares_schemas_and_examples(policy_folder: Path) -> None:
    manifest = json.loads((policy_folder / "manifest.json").read_text())
    assert manifest["name"] == manifest["tag"] == policy_folder.name
    assert manifest["input_schema"]["required"] == ["age", "components"]
    assert set(manifest["result_schema"]["properties"]) == {"total", "action", "reason"}
    first = manifest["examples"][0]
    assert (json.loads(first["input"]), json.loads(first["value"])) == (EXAMPLE, RESULT)


def test_the_template_builds_and_passes_evald_test_as_written(policy_folder: Path) -> None:
    built = cli("build", policy_folder, "--no-grammar-check")
    assert built.status == 0, built.err
    assert built.err == ""
    run = cli("test", policy_folder / f"{policy_folder.name}.wasm",
              policy_folder / "cases.jsonl", "--json")  # fmt: skip
    assert run.status == 0, run.out + run.err
    lines = [json.loads(line) for line in run.out.splitlines()]
    cases = [line for line in lines if "conformance" not in line]
    assert cases and all(case["passed"] for case in cases)
    first = next(case for case in cases if json.loads(case["input"]) == EXAMPLE)
    assert first["value"] == json.dumps(RESULT, separators=(",", ":"))
    assert lines[-1] == {"conformance": {"checks": lines[-1]["conformance"]["checks"],
                                         "problems": []}}  # fmt: skip
    assert lines[-1]["conformance"]["checks"] >= 30


# --- the conformance check, broken each way -------------------------------------------------


@pytest.fixture(scope="module")
def zig_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """The Zig policy template's folder and its compiled code (no manifest yet)."""
    folder = tmp_path_factory.mktemp("policy-broken") / "broken"
    assert cli("new", "broken", "--template", "policy", "--dir", folder).status == 0
    (folder.parent / "original.json").write_bytes((folder / "manifest.json").read_bytes())
    return folder, compile_folder(folder).wasm


def rebuilt(zig_policy: tuple[Path, bytes], change: Callable[[dict[str, Any]], None]) -> bytes:
    """The compiled template with its original manifest changed by ``change``."""
    folder, code = zig_policy
    manifest = json.loads((folder.parent / "original.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return with_manifest(code, folder)


def problems(wasm: bytes) -> list[str]:
    report = check_policy(wasm)
    assert report is not None
    return list(report.problems)


def test_a_wrong_example_value_is_named_by_its_index(zig_policy: tuple[Path, bytes]) -> None:
    def change(manifest: dict[str, Any]) -> None:
        manifest["examples"][2]["value"] = '{"total":10000.5,"action":"decline","reason":"x"}'

    found = problems(rebuilt(zig_policy, change))
    assert len(found) == 1 and found[0].startswith("examples[2]: the module returns "), found


def test_an_example_input_outside_the_input_schema_is_named(zig_policy: tuple[Path, bytes]) -> None:
    def change(manifest: dict[str, Any]) -> None:
        manifest["examples"][1]["input"] = '{"age":16.5,"components":[300]}'

    found = problems(rebuilt(zig_policy, change))
    assert any(p.startswith("examples[1]: the input does not validate against input_schema at "
                            "/age") for p in found), found  # fmt: skip
    assert any(p.startswith("examples[1]: the module answered syntax") for p in found), found


def test_values_outside_the_result_schema_are_named(zig_policy: tuple[Path, bytes]) -> None:
    def change(manifest: dict[str, Any]) -> None:
        manifest["result_schema"]["properties"]["action"]["enum"].remove("decline")

    found = problems(rebuilt(zig_policy, change))
    examples = [p for p in found if p.startswith("examples[")]
    assert examples and all("does not validate against result_schema at /action" in p
                            for p in examples), found  # fmt: skip
    assert {p.split(":")[0] for p in examples} == {"examples[1]", "examples[2]"}
    report = check_policy(
        rebuilt(zig_policy, change), case_inputs=[("cases line 4", '{"age":17,"components":[1]}')]
    )
    assert report is not None
    assert any(p.startswith("cases line 4: the value ") for p in report.problems)


def test_schemas_without_examples_are_a_problem(zig_policy: tuple[Path, bytes]) -> None:
    found = problems(rebuilt(zig_policy, lambda manifest: manifest.pop("examples")))
    assert found == [
        "the manifest declares a schema but no examples: add examples (input and value, as "
        "JSON text) for evald test to check against it"
    ]


def schema_manifest(**changes: Any) -> bytes:
    return manifest_bytes(
        input_schema={"type": "object"},
        examples=[{"input": "{}", "value": "{}"}],
        **changes,
    )


def test_a_module_that_accepts_malformed_json_fails_the_check() -> None:
    found = problems(guest("echo", manifest=schema_manifest()))
    assert "malformed input b'{': the module returned the value '{'" in found
    assert sum(p.startswith("malformed input") for p in found) >= 20


def test_a_module_that_traps_on_malformed_json_fails_the_check() -> None:
    found = problems(guest("trap", manifest=schema_manifest()))
    assert "examples[0]: the module answered guest_fault" in " ".join(found)
    assert any(
        p.startswith("malformed input b'{': the module ended with guest_fault") for p in found
    )


def test_a_module_without_schemas_is_not_checked() -> None:
    assert check_policy(guest("echo")) is None


def test_evald_test_fails_and_names_the_example(zig_policy: tuple[Path, bytes]) -> None:
    folder, _ = zig_policy

    def change(manifest: dict[str, Any]) -> None:
        manifest["examples"][0]["value"] = '{"total":1}'

    rebuilt(zig_policy, change)
    run = cli("test", folder, "--json")
    assert run.status == 1
    report = json.loads(run.out.splitlines()[-1])["conformance"]
    assert [p.split(":")[0] for p in report["problems"]] == ["examples[0]"]
    shown = cli("test", folder)
    assert shown.status == 1
    assert "FAIL conformance: examples[0]: the module returns" in " ".join(shown.out.split())


def test_the_policy_grammars_and_regexes_compile_with_xgrammar() -> None:
    """The template's and the booking policy's input grammar and result regex, as ``evald
    build`` checks them (the template tests build with --no-grammar-check, for speed)."""
    pytest.importorskip("xgrammar")
    from evald.contract import encode_manifest, load_manifest_source, parse_manifest
    from evald.host import check_manifest_grammars
    from evald.sdk import TEMPLATE_DIR
    from evaluators_wasm import EXAMPLES_DIR

    for folder in (TEMPLATE_DIR / "policy", EXAMPLES_DIR / "booking_policy"):
        source = load_manifest_source(folder)
        if source["name"] == "NAME":  # the template's placeholder, which `evald new` fills
            source.update(name="policy", tag="policy", semantics_version="policy/1")
        assert check_manifest_grammars(parse_manifest(encode_manifest(source))), folder
