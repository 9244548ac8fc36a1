"""Malicious modules (WAT): what an attacker tenant uploads, and what must happen to each.

Two kinds, per issue 6:

* modules the daemon must **refuse at registration** (``refusals``): an infinite loop, a
  ``memory.grow`` bomb or deep recursion in the start function, imports of every kind, a memory
  or table above the caps, a data segment outside memory or past the module cap, compile bombs
  (too many functions, locals or bytes of code), bad manifests, buffers outside memory;
* modules that **register and then misbehave on every call** (``accepted``): an infinite loop in
  ``eval``, ``memory.grow`` bombs, deep recursion, oversized and negative output lengths, writes
  past the output buffer and past memory, invalid UTF-8, guest errors that impersonate host codes,
  table bombs, and probes that report how much memory the guest really got.

Each accepted module says which outcomes a call may have; anything else is a violation (a loop
that returns a value has escaped its limits). ``deadline_exceeded`` is always allowed: deadlines
are wall-clock time, and a busy machine that stalls a worker can end even a trivial call.
Modules are built with wasmtime's WAT compiler and :mod:`evald_lab.wat_corpus`, the same generator
the host tests use.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wasmtime

from evald.host import MAX_CODE_BYTES, MAX_FUNCTIONS, MAX_TABLE_ELEMENTS
from evald_lab.harness import padded
from evald_lab.wat_corpus import arg, guest, manifest_bytes, wat_text
from evaluators_wasm.toolchain import MANIFEST_SECTION, append_custom_section

__all__ = ["MaliciousModule", "accepted_modules", "mutated_module", "refused_modules"]

_REFUSED = frozenset({"invalid_module"})
_LIMIT_TRAPS = frozenset({"deadline_exceeded", "fuel_exhausted"})


@dataclass(frozen=True)
class MaliciousModule:
    """One uploaded module and what the daemon must do with it.

    Attributes:
        name: the manifest name (also the tag).
        family: the attack it represents.
        wasm: the module bytes.
        refusal: when set, registration must fail with one of these codes.
        expected: for an accepted module, the outcomes a call may have.
        draw_input: the input of one call.
        heavy: each call burns the tenant's whole fuel or deadline.
        probe: ``memory_pages`` when the value is the guest's page count (checked against the
            memory limit).
    """

    name: str
    family: str
    wasm: bytes
    refusal: frozenset[str] = frozenset()
    expected: frozenset[str] = frozenset()
    draw_input: Callable[[random.Random], bytes] = lambda _rng: b"x"
    heavy: bool = False
    probe: str = ""


def _manifest(name: str, **changes: object) -> bytes:
    return manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1", **changes)


def _build(name: str, kind: str = "echo", param: object = None, **options: Any) -> bytes:
    return guest(kind, param, manifest=_manifest(name), **options)


def _from_wat(name: str, wat: str) -> bytes:
    return append_custom_section(bytes(wasmtime.wat2wasm(wat)), MANIFEST_SECTION, _manifest(name))


def _with_getter(name: str, export: str, value: int) -> bytes:
    """An echo module whose buffer getter ``export`` returns ``value`` (an i32)."""
    wat = wat_text("echo")
    marker = f'(func (export "{export}") (result i32) (i32.const '
    start = wat.index(marker) + len(marker)
    end = wat.index(")", start)
    return _from_wat(name, wat[:start] + str(value) + wat[end:])


def _fixed(data: bytes) -> Callable[[random.Random], bytes]:
    return lambda _rng: data


def _one_of(*choices: bytes) -> Callable[[random.Random], bytes]:
    return lambda rng: rng.choice(choices)


def refused_modules(prefix: str, *, memory_bytes: int, module_bytes: int) -> list[MaliciousModule]:
    """Modules registration must refuse. ``prefix`` keeps names unique per run."""

    def name(label: str) -> str:
        return f"{prefix}{label}"[:32]

    recursion = (
        "(func $down (param i32) (result i32) (call $down (i32.add (local.get 0) (i32.const 1))))"
    )
    pages_over = memory_bytes // 65536 + 1
    many_functions = "".join(f"(func (result i32) (i32.const {i}))" for i in range(MAX_FUNCTIONS))
    modules = [
        MaliciousModule(
            name("start_loop"),
            "infinite_loop_in_start",
            _build(name("start_loop"), start="(loop $l (br $l))"),
            _REFUSED,
        ),
        MaliciousModule(
            name("start_grow"),
            "memory_grow_bomb_in_start",
            _build(
                name("start_grow"),
                start="(if (i32.eq (memory.grow (i32.const 65535)) (i32.const -1)) "
                "(then (unreachable)))",
            ),
            _REFUSED,
        ),
        MaliciousModule(
            name("start_recurse"),
            "deep_recursion_in_start",
            _build(
                name("start_recurse"), start="(drop (call $down (i32.const 0)))", extra=recursion
            ),
            _REFUSED,
        ),
        MaliciousModule(
            name("import_func"),
            "import_function",
            _build(name("import_func"), imports='(import "env" "now" (func (result i64)))'),
            _REFUSED,
        ),
        MaliciousModule(
            name("import_wasi"),
            "import_wasi",
            _build(
                name("import_wasi"),
                imports='(import "wasi_snapshot_preview1" "fd_write" '
                "(func (param i32 i32 i32 i32) (result i32)))",
            ),
            _REFUSED,
        ),
        MaliciousModule(
            name("import_global"),
            "import_global",
            _build(name("import_global"), imports='(import "env" "g" (global i32))'),
            _REFUSED,
        ),
        MaliciousModule(
            name("import_table"),
            "import_table",
            _build(name("import_table"), imports='(import "env" "t" (table 1 funcref))'),
            _REFUSED,
        ),
        MaliciousModule(
            name("import_memory"),
            "import_memory",
            _build(name("import_memory"), imports='(import "env" "m" (memory 1))'),
            _REFUSED,
        ),
        MaliciousModule(
            name("huge_memory"),
            "memory_minimum_above_cap",
            _build(name("huge_memory"), pages=pages_over),
            _REFUSED,
        ),
        MaliciousModule(
            name("max_memory"),
            "memory_minimum_4gib",
            _build(name("max_memory"), pages=65536),
            _REFUSED,
        ),
        MaliciousModule(
            name("data_oob"),
            "data_segment_outside_memory",
            _build(name("data_oob"), extra='(data (i32.const 16777216) "boom")'),
            _REFUSED,
        ),
        MaliciousModule(
            name("data_over_cap"),
            "huge_data_segment_over_module_cap",
            padded(_build(name("data_over_cap")), module_bytes + 1),
            _REFUSED,
        ),
        MaliciousModule(
            name("table_bomb"),
            "table_above_cap",
            _build(name("table_bomb"), "table_fill", MAX_TABLE_ELEMENTS + 1),
            _REFUSED,
        ),
        MaliciousModule(
            name("table_4g"),
            "table_4g_elements",
            _build(name("table_4g"), "table_fill", 4_294_967_295),
            _REFUSED,
        ),
        MaliciousModule(
            name("many_funcs"),
            "compile_bomb_functions",
            _build(name("many_funcs"), extra=many_functions),
            _REFUSED,
        ),
        MaliciousModule(
            name("many_locals"),
            "compile_bomb_locals",
            _build(name("many_locals"), extra="(func (local " + " i64" * 50_001 + "))"),
            _REFUSED,
        ),
        MaliciousModule(
            name("big_code"),
            "compile_bomb_code_bytes",
            _build(name("big_code"), extra="(func " + "nop " * (MAX_CODE_BYTES + 16) + ")"),
            _REFUSED,
        ),
        MaliciousModule(
            name("out_ptr_oob"),
            "output_pointer_outside_memory",
            _with_getter(name("out_ptr_oob"), "evald_output_ptr", 0x7FFF_FFF0),
            _REFUSED,
        ),
        MaliciousModule(
            name("out_ptr_neg"),
            "output_pointer_negative",
            _with_getter(name("out_ptr_neg"), "evald_output_ptr", -16),
            _REFUSED,
        ),
        MaliciousModule(
            name("out_cap_huge"),
            "output_capacity_past_memory",
            _with_getter(name("out_cap_huge"), "evald_output_cap", 0x7FFF_FFFF),
            _REFUSED,
        ),
        MaliciousModule(
            name("in_cap_zero"),
            "input_capacity_zero",
            _with_getter(name("in_cap_zero"), "evald_input_cap", 0),
            _REFUSED,
        ),
        MaliciousModule(
            name("buffers_oob"),
            "buffer_outside_memory",
            _build(name("buffers_oob"), in_ptr=65536 - 16),
            _REFUSED,
        ),
        MaliciousModule(
            name("abi_two"), "wrong_abi_version", _build(name("abi_two"), abi_version=2), _REFUSED
        ),
        MaliciousModule(
            name("no_eval"),
            "missing_export",
            _build(name("no_eval"), omit=("evald_eval",)),
            _REFUSED,
        ),
        MaliciousModule(
            name("bad_eval"),
            "mistyped_export",
            _build(name("bad_eval"), retype={"evald_eval": "(param i64) (result i32)"}),
            _REFUSED,
        ),
        MaliciousModule(
            name("no_manifest"), "missing_manifest", guest("echo", manifests=0), _REFUSED
        ),
        MaliciousModule(
            name("two_manifests"),
            "two_manifests",
            guest("echo", manifest=_manifest(name("two_manifests")), manifests=2),
            _REFUSED,
        ),
        MaliciousModule(
            name("json"), "manifest_not_json", guest("echo", manifest=b"{not json"), _REFUSED
        ),
        MaliciousModule(
            name("huge_manifest"),
            "manifest_over_64kib",
            guest("echo", manifest=_manifest(name("huge_manifest"), description="x" * 70_000)),
            _REFUSED,
        ),
        MaliciousModule(
            "calc_shadow",
            "reserved_name",
            guest(
                "echo", manifest=manifest_bytes(name="calc", tag="calc", semantics_version="calc/9")
            ),
            frozenset({"invalid_argument"}),
        ),
        MaliciousModule(
            "bad name",
            "manifest_bad_name",
            guest("echo", manifest=manifest_bytes(name="Bad Name", tag="bad")),
            _REFUSED,
        ),
        MaliciousModule(
            name("not_wasm"), "not_webassembly", b"\0asm\x01\0\0\0" + b"\xff" * 64, _REFUSED
        ),
        MaliciousModule(name("wat_text"), "text_not_binary", b"(module (func))", _REFUSED),
        MaliciousModule(name("empty"), "empty_module", b"", _REFUSED),
        # Result or input languages that can produce '<': a forced value could spell
        # </result> or a chat template's special tokens (a role injection).
        *(
            MaliciousModule(
                name(f"lt_{label}"),
                f"lt_in_{label}",
                guest("echo", manifest=_manifest(name(f"lt_{label}"), **{field: text})),
                _REFUSED,
            )
            for label, field, text in (
                ("regex", "result_regex", "[^#]*"),
                ("regex_escape", "result_regex", "[0-9]|\\x3c"),
                ("grammar", "input_grammar", 'root ::= [^"]+'),
            )
        ),
    ]
    return modules


def accepted_modules(prefix: str, *, output_bytes: int, shadow_name: str) -> list[MaliciousModule]:
    """Modules that register and must fail every call with a typed error (or stay in bounds).

    ``shadow_name`` is another tenant's module name: the attacker registers its own module under
    it (names are per tenant) and must only ever reach its own.
    """

    def name(label: str) -> str:
        return f"{prefix}{label}"[:32]

    out_cap = max(8192, output_bytes * 2)
    huge_data = '(data (i32.const 65536) "' + "\\41" * (3 * 2**20 // 4) + '")'
    return [
        MaliciousModule(
            name("loop"),
            "infinite_loop_in_eval",
            _build(name("loop"), "loop"),
            expected=_LIMIT_TRAPS,
            heavy=True,
        ),
        MaliciousModule(
            name("burn"),
            "bounded_burn",
            _build(name("burn"), "burn"),
            expected=frozenset({"ok"}) | _LIMIT_TRAPS,
            draw_input=lambda rng: arg(rng.choice((10, 1000, 100_000))),
        ),
        MaliciousModule(
            name("grow"),
            "memory_grow_bomb",
            _build(name("grow"), "grow"),
            expected=frozenset({"memory_limit"}),
            draw_input=_one_of(arg(60_000), arg(65_535), arg(-1), arg(2**30)),
        ),
        MaliciousModule(
            name("grow_pages"),
            "memory_grow_page_by_page",
            _build(name("grow_pages"), "grow_pages"),
            expected=frozenset({"memory_limit"}),
            draw_input=_fixed(arg(70_000)),
        ),
        MaliciousModule(
            name("probe"),
            "memory_probe",
            _build(name("probe"), "memory_probe"),
            expected=frozenset({"ok"}),
            probe="memory_pages",
        ),
        MaliciousModule(
            name("recurse"),
            "deep_recursion",
            _build(name("recurse"), "recurse"),
            expected=frozenset({"stack_overflow"}) | _LIMIT_TRAPS,
            draw_input=_one_of(arg(10_000_000), arg(2**31 - 1)),
        ),
        MaliciousModule(
            name("len_over_cap"),
            "output_length_over_buffer",
            _build(name("len_over_cap"), "return", 4097),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("len_max"),
            "output_length_i32_max",
            _build(name("len_max"), "return", 2**31 - 1),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("len_min"),
            "output_length_i32_min",
            _build(name("len_min"), "return", -(2**31)),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("len_neg"),
            "error_length_over_buffer",
            _build(name("len_neg"), "return", -5000),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("out_limit"),
            "output_over_tenant_limit",
            _build(name("out_limit"), "output", out_cap=out_cap),
            expected=frozenset({"ok", "output_too_large"}),
            draw_input=_one_of(
                arg(output_bytes - 1), arg(output_bytes), arg(output_bytes + 1), arg(out_cap)
            ),
        ),
        MaliciousModule(
            name("write_past"),
            "writes_past_its_buffer",
            _build(name("write_past"), "output"),
            expected=frozenset({"guest_fault"}),
            draw_input=_one_of(arg(4096 + 100), arg(10_000_000), arg(2**31 - 1)),
        ),
        MaliciousModule(
            name("oob"),
            "out_of_bounds_access",
            _build(name("oob"), "oob"),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("trap"),
            "unreachable",
            _build(name("trap"), "trap"),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("bad_utf8"),
            "invalid_utf8_output",
            _build(name("bad_utf8"), "payload", (b"\xff\xfe\xc0\x80", False)),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("fake_host"),
            "guest_claims_host_code",
            _build(name("fake_host"), "payload", (b"permission_denied:tenant victim", True)),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("fake_fuel"),
            "guest_claims_fuel_code",
            _build(name("fake_fuel"), "payload", (b"fuel_exhausted", True)),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("unknown_code"),
            "guest_unknown_code",
            _build(name("unknown_code"), "payload", (b"nope:x", True)),
            expected=frozenset({"guest_fault"}),
        ),
        MaliciousModule(
            name("guest_error"),
            "guest_error",
            _build(name("guest_error"), "payload", (b"syntax:" + b"m" * 3000, True)),
            # the payload is a data segment: after the host zeroes the returned bytes, the next
            # call on the same instance returns NULs, which name no code
            expected=frozenset({"syntax", "guest_fault"}),
        ),
        MaliciousModule(
            name("table_grow"),
            "table_grow_bomb",
            _build(name("table_grow"), "table_grow"),
            expected=frozenset({"ok"}),
            draw_input=_one_of(arg(60_000_000), arg(MAX_TABLE_ELEMENTS), arg(2**31 - 1)),
        ),
        MaliciousModule(
            name("table_fill"),
            "table_fill_at_cap",
            _build(name("table_fill"), "table_fill", MAX_TABLE_ELEMENTS),
            expected=frozenset({"ok"}),
        ),
        MaliciousModule(
            name("big_data"),
            "huge_data_segment",
            _build(name("big_data"), pages=64, extra=huge_data),
            expected=frozenset({"ok"}),
        ),
        MaliciousModule(
            name("locals"),
            "many_locals",
            _build(name("locals"), extra="(func (local " + " i64" * 5_000 + "))"),
            expected=frozenset({"ok"}),
        ),
        MaliciousModule(
            name("count"),
            "state_across_calls",
            _build(name("count"), "count"),
            expected=frozenset({"ok", "guest_fault"}),
            draw_input=_one_of(b"", b"x"),
        ),
        # Reads whatever is left in its own buffers: never another tenant's data (checked by
        # the canaries), registered under another tenant's module name.
        MaliciousModule(
            shadow_name,
            "shadow_name_dump_input",
            guest("dump_input", 4096, manifest=_manifest(shadow_name)),
            expected=frozenset({"ok", "guest_fault"}),
            draw_input=_one_of(b"", b"x", struct.pack("<i", 7)),
        ),
        MaliciousModule(
            name("stale"),
            "stale_output_buffer",
            _build(name("stale"), "stale_output", 4096),
            expected=frozenset({"ok", "guest_fault"}),
            draw_input=_one_of(b"", b"xy"),
        ),
    ]


def mutated_module(base: bytes, rng: random.Random) -> bytes:
    """``base`` with a few bytes flipped, cut or inserted: for registration fuzzing."""
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(4)
        index = rng.randrange(8, len(data)) if len(data) > 8 else 0
        if choice == 0:
            data[index] ^= 1 << rng.randrange(8)
        elif choice == 1:
            data[index] = rng.randrange(256)
        elif choice == 2:
            del data[index : index + rng.randint(1, 16)]
        else:
            data[index:index] = rng.randbytes(rng.randint(1, 16))
    return bytes(data)
