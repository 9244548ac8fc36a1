"""The example policy ``booking_policy`` (evaluators_wasm/examples/booking_policy, Zig with the
SDK's evald_json): it agrees with its Python reference on every band boundary, on decimals, on
missing facts and on malformed input, error codes included; it passes ``evald test``'s policy
conformance check; and its committed module is what the SDK's build makes of its folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evald.host import HostConfig, Limits, LoadedModule, WasmHost
from evald.sdk import check_policy
from evaluators_wasm import EXAMPLES_DIR, example_path
from evaluators_wasm.reference import GuestError
from evaluators_wasm.reference.booking_policy import evaluate
from tests.evaluators_wasm.support import property_settings

LIMITS = Limits(fuel=2_000_000_000)


def request(age: object, *components: object) -> bytes:
    return json.dumps({"age": age, "components": list(components)}).encode()


#: Every band boundary, both age limits, missing facts, decimals and malformed input.
INPUTS: list[bytes] = [
    request(34, 6500, 1200),
    request(40, 10000),
    request(40, 10001),
    request(40, 12000),
    request(40, 12001),
    request(40, 5000, 5000),
    request(40, 5000, 5001),
    request(40, 6000, 6000),
    request(40, 6000, 6001),
    request(17, 100),
    request(18, 100),
    request(70, 100),
    request(71, 100),
    request(0, 100),
    request(-3, 100),
    request(120, 100),
    request(None, 100),
    request(30),
    request(None),
    b'{"age": 30, "components": null}',
    b'{"components": [100]}',
    b'{"age": 30}',
    b"{}",
    b'{"age":30,"components":[10000.00]}',
    b'{"age":30,"components":[10000.01]}',
    b'{"age":30,"components":[11999.99, 0.01]}',
    b'{"age":30,"components":[12000.001]}',
    b'{"age":30,"components":[0.1, 0.2]}',
    b'{"age":30,"components":[4999.995, 5000.005]}',
    b'{"age":30,"components":[1e4]}',
    b'{"age":30,"components":[1.0001e4]}',
    b'{"age":30,"components":[0.000000000000000001]}',
    b'{"age":30,"components":[0.0000000000000000001]}',
    b'{"age":30,"components":[1e-19]}',
    b'{"age":30,"components":[123456789012345678]}',
    b'{"age":30,"components":[1234567890123456789]}',
    b'{"age":30,"components":[9e18]}',
    b'{"age":30,"components":[5e18, 5e18]}',
    b'{"age":30,"components":[1e1001]}',
    b'{"age":30,"components":[0e1000]}',
    b'{"age":30,"components":[-0]}',
    b'{"age":30,"components":[-1]}',
    b'{"age":30.0,"components":[1]}',
    b'{"age":3.5e1,"components":[1]}',
    b'{"age":30.5,"components":[1]}',
    b'{"age":"30","components":[1]}',
    b'{"age":true,"components":[1]}',
    b'{"age":30,"components":["1"]}',
    b'{"age":30,"components":{"a":1}}',
    b'{"age":30,"age":17,"components":[1]}',
    b'{"\\u0061ge":30,"components":[1]}',
    b'  {"age" : 30 , "components" : [ 1 , 2 ] }\n',
    b'{"age":30,"components":[1],"note":"x\\ud834\\udd1e<"}',
    b'{"age":30,"components":[1],"note":"\\ud800"}',
    b'{"age":30,"components":[1]',
    b'{"age":30,"components":[1]} x',
    b'{"age":30,"components":[1,]}',
    b'{"age":30,"components":[01]}',
    b'{"age":NaN,"components":[1]}',
    b"[30, [1]]",
    b"null",
    b"",
    b"\xff",
    b'{"a":' * 32 + b"1" + b"}" * 32,
    b'{"a":' * 33 + b"1" + b"}" * 33,
]


@pytest.fixture(scope="module")
def policy() -> Iterator[tuple[WasmHost, LoadedModule]]:
    with WasmHost(HostConfig(epoch_tick_ms=0)) as host:
        yield host, host.load(example_path("booking_policy").read_bytes(), limits=LIMITS)


def guest_says(policy: tuple[WasmHost, LoadedModule], data: bytes) -> tuple[str, str]:
    host, module = policy
    outcome = host.evaluate(module, data, LIMITS)
    if outcome.error is not None:
        return "error", outcome.error.value
    assert outcome.value is not None
    return "value", outcome.value


def reference_says(data: bytes) -> tuple[str, str]:
    try:
        return "value", evaluate(data)
    except GuestError as error:
        return "error", error.code


def test_the_inputs_cover_every_band_and_outcome() -> None:
    results = [reference_says(data) for data in INPUTS]
    values = [json.loads(text) for kind, text in results if kind == "value"]
    decisions = {(value["action"], value["reason"]) for value in values}
    assert len(INPUTS) >= 40
    assert decisions == {
        ("book_appointment", "eligible"),
        ("offer_alternative", "over_limit"),
        ("decline", "over_limit"),
        ("decline", "under_age"),
        ("decline", "over_age"),
        ("escalate_human", "insufficient_info"),
    }
    assert {code for kind, code in results if kind == "error"} == {"syntax", "domain", "too_large"}


@pytest.mark.parametrize("data", INPUTS, ids=[repr(d[:40]) for d in INPUTS])
def test_guest_agrees_with_the_reference(
    policy: tuple[WasmHost, LoadedModule], data: bytes
) -> None:
    assert guest_says(policy, data) == reference_says(data)


def test_the_reference_decides_the_documented_bands() -> None:
    """The reference is the semantics: pin its answers at the boundaries."""

    def decision(data: bytes) -> tuple[object, str, str]:
        value = json.loads(evaluate(data), parse_float=Decimal)
        return value["total"], value["action"], value["reason"]

    assert decision(request(34, 6500, 1200)) == (7700, "book_appointment", "eligible")
    assert decision(request(18, 10000)) == (10000, "book_appointment", "eligible")
    assert decision(request(70, 10001)) == (10001, "offer_alternative", "over_limit")
    assert decision(request(40, 12000)) == (12000, "offer_alternative", "over_limit")
    assert decision(request(40, 12001)) == (12001, "decline", "over_limit")
    assert decision(request(17, 1)) == (1, "decline", "under_age")
    assert decision(request(71, 1)) == (1, "decline", "over_age")
    assert decision(request(None, 1)) == (1, "escalate_human", "insufficient_info")
    assert decision(request(30)) == (None, "escalate_human", "insufficient_info")
    assert decision(b'{"age":30,"components":[0.1,0.2]}')[0] == Decimal("0.3")
    assert decision(b'{"age":30,"components":[10000.001]}')[1] == "offer_alternative"


amounts = st.one_of(
    st.integers(0, 20_000),
    st.decimals(min_value=0, max_value=20_000, places=2, allow_nan=False),
    st.sampled_from([10000, 10001, 12000, 12001, Decimal("10000.01"), Decimal("11999.99")]),
)


@property_settings(full=2_000, quick=150)
@given(
    age=st.one_of(st.none(), st.integers(-5, 130)),
    components=st.lists(amounts, max_size=6),
)
def test_guest_agrees_on_generated_requests(
    policy: tuple[WasmHost, LoadedModule], age: int | None, components: list[object]
) -> None:
    listed = ", ".join(str(amount) for amount in components)  # decimals as written: 1.5E+3
    data = f'{{"age": {json.dumps(age)}, "components": [{listed}]}}'.encode()
    assert guest_says(policy, data) == reference_says(data)


def test_passes_the_policy_conformance_check() -> None:
    report = check_policy(example_path("booking_policy").read_bytes())
    assert report is not None and report.passed, report
    assert report.checks >= 20


def test_rebuilds_byte_identically_from_another_folder(tmp_path: Path) -> None:
    """What ``make examples`` and ``evald build`` make of the folder is the committed module."""
    pytest.importorskip("ziglang")
    from evald.sdk import build_evaluator

    copy = tmp_path / "elsewhere" / "booking_policy"
    shutil.copytree(EXAMPLES_DIR / "booking_policy", copy, ignore=shutil.ignore_patterns("*.wasm"))
    assert build_evaluator(copy) == example_path("booking_policy").read_bytes(), (
        "rebuilding booking_policy gives other bytes: run make examples"
    )
