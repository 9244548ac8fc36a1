"""The malicious-module tables, without a daemon: every row says what must happen, names are
unique and valid per run, and the attacks sized against a limit sit just past it.

The short fuzz profile (test_fuzz.py) registers every one of them against a real daemon; these
checks catch a broken row before that, and say which row.
"""

from __future__ import annotations

import random

import wasmtime

from evald.testing import arg
from evald_lab.fuzz.modules import accepted_modules, refused_modules
from evald_lab.fuzz.modules.accepted import REGISTERED_THEN_MISBEHAVING
from evald_lab.fuzz.modules.build import AttackParams
from evald_lab.fuzz.modules.refused import REFUSED_AT_REGISTRATION

PREFIX = "m1234_"
MEMORY_BYTES = 8 * 2**20
MODULE_BYTES = 4 * 2**20
OUTPUT_BYTES = 4096
SHADOW = "v_echo_0123456789"


def _memory_minimum_pages(wasm: bytes) -> int:
    module = wasmtime.Module(wasmtime.Engine(), wasm)
    (memory,) = [e.type for e in module.exports if isinstance(e.type, wasmtime.MemoryType)]
    return memory.limits.min


def test_every_row_says_what_must_happen_and_names_are_unique() -> None:
    refused = refused_modules(PREFIX, memory_bytes=MEMORY_BYTES, module_bytes=MODULE_BYTES)
    accepted = accepted_modules(PREFIX, output_bytes=OUTPUT_BYTES, shadow_name=SHADOW)
    assert len(refused) == len(REFUSED_AT_REGISTRATION)
    assert len(accepted) == len(REGISTERED_THEN_MISBEHAVING)
    for module in refused:
        assert module.refusal and not module.expected, module.family
    for module in accepted:
        assert module.expected and not module.refusal, module.family
        assert module.wasm.startswith(b"\0asm"), module.family
    for modules in (refused, accepted):
        names = [module.name for module in modules]
        assert len(set(names)) == len(names), names
        families = [module.family for module in modules]
        assert len(set(families)) == len(families), families
        assert all(len(name) <= 32 for name in names), names


def test_names_follow_each_rows_naming() -> None:
    refused = {
        module.family: module
        for module in refused_modules(PREFIX, memory_bytes=MEMORY_BYTES, module_bytes=MODULE_BYTES)
    }
    accepted = {
        module.family: module
        for module in accepted_modules(PREFIX, output_bytes=OUTPUT_BYTES, shadow_name=SHADOW)
    }
    assert refused["infinite_loop_in_start"].name == f"{PREFIX}start_loop"
    assert refused["reserved_name"].name == "calc_shadow"
    assert refused["reserved_name"].refusal == {"invalid_argument"}
    assert refused["manifest_bad_name"].name == "bad name"
    assert accepted["shadow_name_dump_input"].name == SHADOW
    assert accepted["infinite_loop_in_eval"].heavy
    assert accepted["memory_probe"].probe == "memory_pages"
    long = AttackParams("p" * 30).name("long_label", "prefixed")
    assert long == ("p" * 30 + "long_label")[:32]


def test_attacks_sized_against_a_limit_sit_just_past_it() -> None:
    refused = {
        module.family: module
        for module in refused_modules(PREFIX, memory_bytes=MEMORY_BYTES, module_bytes=MODULE_BYTES)
    }
    assert len(refused["huge_data_segment_over_module_cap"].wasm) == MODULE_BYTES + 1
    assert _memory_minimum_pages(refused["memory_minimum_above_cap"].wasm) == (
        MEMORY_BYTES // 65536 + 1
    )
    small_limit = 1000  # twice it is still under the 8 KiB floor of the buffer
    accepted = {
        module.family: module
        for module in accepted_modules(PREFIX, output_bytes=small_limit, shadow_name=SHADOW)
    }
    out_limit = accepted["output_over_tenant_limit"]
    draws = {out_limit.draw_input(random.Random(seed)) for seed in range(64)}
    # the buffer is larger than the limit (at least 8 KiB), so the limit is what stops it
    assert draws == {arg(small_limit - 1), arg(small_limit), arg(small_limit + 1), arg(8192)}


def test_inputs_are_drawn_from_the_steps_generator() -> None:
    accepted = accepted_modules(PREFIX, output_bytes=OUTPUT_BYTES, shadow_name=SHADOW)
    for module in accepted:
        first = [module.draw_input(random.Random(7)) for _ in range(3)]
        assert len(set(first)) == 1, module.family  # the same seed, the same input
