"""The ports (``evaluators_wasm/ports/``) are the standard evaluator under another name: the same
grammar, result regex, literals, examples and semantics version, and tenant folders like any
other (a name of their own, not reserved, outside the standard set the daemon serves)."""

from __future__ import annotations

import json

import pytest

from evald.contract import STANDARD_EVALUATORS, load_manifest_source
from evaluators_wasm import PORTS, PORTS_DIR, SOURCE_DIR, WASM_DIR, port_path

#: What a port may change in its standard evaluator's manifest.
OWN_FIELDS = {"name", "tag", "version", "description"}


@pytest.mark.parametrize("name", sorted(PORTS))
def test_a_port_declares_what_its_standard_evaluator_declares(name: str) -> None:
    standard = PORTS[name][0]
    port = load_manifest_source(PORTS_DIR / name)
    original = load_manifest_source(SOURCE_DIR / standard)
    assert set(port) == set(original)
    assert {k: v for k, v in port.items() if k not in OWN_FIELDS} == {
        k: v for k, v in original.items() if k not in OWN_FIELDS
    }
    assert port["name"] == port["tag"] == name and name.startswith(f"{standard}_")
    assert port["semantics_version"] == original["semantics_version"]  # the same semantics
    assert json.loads((PORTS_DIR / name / "manifest.json").read_text())["name"] == name
    assert port_path(name).is_file(), f"{name}.wasm is not built: run make ports"


def test_the_ports_are_not_part_of_the_standard_set() -> None:
    assert not set(PORTS) & set(STANDARD_EVALUATORS)
    assert not {path.stem for path in WASM_DIR.glob("*.wasm")} & set(PORTS)
    assert {path.name for path in PORTS_DIR.iterdir() if path.is_dir()} == set(PORTS)
