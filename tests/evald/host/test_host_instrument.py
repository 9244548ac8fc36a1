"""The memory.grow rewrite: it keeps a module's behaviour and only adds the refusal flag; and
the fresh wrapper, which puts every mutable global back before a call, only where nothing else
in the module can keep state."""

from __future__ import annotations

import pytest
import wasmtime

from evald.contract import MANIFEST_SECTION, append_custom_section
from evald.host import HostConfig, inspect_module
from evald.host._engine import make_engine_config
from evald.host._instrument import (
    EVAL_WRAPPER_EXPORT,
    FRESH_WRAPPER_EXPORT,
    GROW_FLAG_EXPORT,
    instrument_memory_grow,
    reset_blocker,
)
from evald.host._wasm_binary import parse_module
from evald.testing import manifest_bytes
from evaluators_wasm import wasm_path

# memory.grow in many positions, next to instructions with every kind of immediate the
# reader must step over (block types, br_table, call_indirect, typed select, memargs,
# constants of each width, bulk memory, SIMD lanes and shuffles, ref.func).
BUSY_WAT = """
(module
  (type $unary (func (param i32) (result i32)))
  (memory (export "memory") 1 100)
  (table 2 funcref)
  (elem (i32.const 0) $twice $grow_by)
  (global $g (mut i64) (i64.const -9223372036854775808))
  (func $twice (type $unary) (i32.mul (local.get 0) (i32.const 2)))
  (func $grow_by (type $unary) (memory.grow (local.get 0)))
  (func (export "evald_abi_version") (result i32) (i32.const 1))
  (func (export "evald_input_ptr") (result i32) (i32.const 16))
  (func (export "evald_input_cap") (result i32) (i32.const 16))
  (func (export "evald_output_ptr") (result i32) (i32.const 32))
  (func (export "evald_output_cap") (result i32) (i32.const 16))
  (func (export "evald_eval") (param $n i32) (result i32) (local $acc i32) (local $v v128)
    (block $a (block $b (block $c
      (br_table $a $b $c (i32.and (local.get $n) (i32.const 3))))
      (local.set $acc (i32.add (memory.grow (i32.const 1)) (i32.const 100)))  ;; n & 3 >= 2
      (br $a))
      (local.set $acc (call_indirect (type $unary) (i32.const 1) (i32.const 1))))  ;; n & 3 = 1
    (local.set $acc (i32.add (local.get $acc)
      (if (result i32) (i32.eqz (local.get $n))
        (then (memory.grow (i32.const 0)))
        (else (select (result i32) (memory.grow (i32.const 1)) (i32.const 7)
                      (local.get $n))))))
    (loop $l
      (local.set $v (i8x16.shuffle 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15
        (v128.const i32x4 1 2 3 4) (v128.load offset=0 align=1 (i32.const 0))))
      (drop (i32x4.extract_lane 2 (local.get $v)))
      (drop (f64.add (f64.const 1.5) (f64.convert_i32_s (memory.grow (i32.const 0)))))
      (drop (f32.const -0.25))
      (global.set $g (i64.add (global.get $g) (i64.const 0x7fffffffffff)))
      (memory.fill (i32.const 48) (i32.const 0) (i32.const 4))
      (drop (ref.func $twice))
      (br_if $l (i32.lt_s (memory.grow (i32.const 0)) (i32.const 0))))
    (i32.store (i32.const 32) (i32.add (local.get $acc) (memory.size)))
    (i32.const 4))
)
"""


def any_grow_refused(n: int, cap_pages: int) -> bool:
    """What BUSY_WAT's evald_eval(n) asks of memory.grow, replayed against a page cap."""
    deltas = [1] if n & 3 else []  # the br_table arms (directly, or through call_indirect)
    deltas.append(0 if n == 0 else 1)  # the if / select
    pages = 1
    refused = False
    for delta in deltas:
        if pages + delta > cap_pages:
            refused = True
        else:
            pages += delta
    return refused


def busy_module() -> bytes:
    return append_custom_section(wasmtime.wat2wasm(BUSY_WAT), MANIFEST_SECTION, manifest_bytes())


class Compiler:
    """One engine configured like the host's, compiling each module once (per test)."""

    def __init__(self) -> None:
        self.engine = wasmtime.Engine(make_engine_config(HostConfig(), pooling=False))
        self._modules: dict[bytes, wasmtime.Module] = {}

    def __call__(self, wasm: bytes) -> wasmtime.Module:
        wasm = bytes(wasm)
        if wasm not in self._modules:
            self._modules[wasm] = wasmtime.Module(self.engine, wasm)
        return self._modules[wasm]


@pytest.fixture
def compiled() -> Compiler:
    return Compiler()


def run_plain(
    compiled: Compiler, wasm: bytes, export: str, arg: int, memory_cap: int
) -> tuple[tuple[object, object], bytes]:
    """Runs one export with plain wasmtime-py: ((result or trap code, flag), output bytes)."""
    store = wasmtime.Store(compiled.engine)
    store.set_fuel(10**9)
    store.set_epoch_deadline(10**9)
    store.set_limits(memory_size=memory_cap)
    instance = wasmtime.Instance(store, compiled(wasm), [])
    exports = instance.exports(store)
    memory = exports["memory"]
    try:
        result: object = exports[export](store, arg)
    except wasmtime.Trap as trap:
        result = trap.trap_code
    flag = exports[GROW_FLAG_EXPORT].value(store) if GROW_FLAG_EXPORT in exports else None
    return (result, flag), bytes(memory.read(store, 32, 36))


def instrumented(wasm: bytes) -> bytes:
    _, info = inspect_module(wasm)
    eval_index = next(e.index for e in info.exports if e.name == "evald_eval")
    rewritten = instrument_memory_grow(wasm, info, eval_index)
    assert rewritten is not None
    return rewritten


def test_the_rewrite_keeps_behaviour_and_adds_the_flag(compiled: Compiler) -> None:
    wasm = busy_module()
    rewritten = instrumented(wasm)
    info = parse_module(rewritten)
    names = {export.name for export in info.exports}
    assert {EVAL_WRAPPER_EXPORT, GROW_FLAG_EXPORT} <= names
    original = parse_module(wasm).function_types
    assert original == info.function_types[: len(original)]  # indices kept
    assert len(info.function_types) == len(original) + 3  # grow hook, wrapper, fresh wrapper
    for n in range(8):
        for cap_pages in (1, 2, 100):
            (original, _), original_out = run_plain(
                compiled, wasm, "evald_eval", n, cap_pages * 65536
            )
            (result, flag), out = run_plain(
                compiled, rewritten, EVAL_WRAPPER_EXPORT, n, cap_pages * 65536
            )
            assert (result, out) == (original, original_out), (n, cap_pages)
            assert flag == int(any_grow_refused(n, cap_pages)), (n, cap_pages)


def test_the_custom_sections_survive() -> None:
    rewritten = instrumented(busy_module())
    sections = parse_module(rewritten).custom_sections(MANIFEST_SECTION)
    assert len(sections) == 1
    assert rewritten[sections[0].payload_start : sections[0].end] == manifest_bytes()


def test_a_module_without_globals_gets_a_global_section(compiled: Compiler) -> None:
    wat = BUSY_WAT.replace("(global $g (mut i64) (i64.const -9223372036854775808))", "")
    wat = wat.replace("(global.set $g (i64.add (global.get $g) (i64.const 0x7fffffffffff)))", "")
    wasm = append_custom_section(wasmtime.wat2wasm(wat), MANIFEST_SECTION, manifest_bytes())
    assert parse_module(wasm).section(6) is None
    rewritten = instrumented(wasm)
    assert parse_module(rewritten).global_count == 2  # the grow flag and the guest size
    (_, flag), _ = run_plain(compiled, rewritten, EVAL_WRAPPER_EXPORT, 1, 65536)
    assert flag == 1


def test_an_opcode_outside_the_enabled_features_leaves_the_module_as_is() -> None:
    wat = """(module (memory (export "memory") 1 1 shared)
               (func (export "evald_eval") (param i32) (result i32)
                 (atomic.fence) (memory.grow (i32.const 1))))"""
    wasm = wasmtime.wat2wasm(wat)
    info = parse_module(wasm)
    assert instrument_memory_grow(wasm, info, 0) is None


def test_a_real_zig_module_behaves_the_same_rewritten(compiled: Compiler) -> None:
    path = wasm_path("calc")
    if not path.exists():
        pytest.skip("calc.wasm is not built")
    wasm = path.read_bytes()
    rewritten = instrumented(wasm)
    outputs = []
    for code, export in ((wasm, "evald_eval"), (rewritten, EVAL_WRAPPER_EXPORT)):
        store = wasmtime.Store(compiled.engine)
        store.set_fuel(10**10)
        store.set_epoch_deadline(10**9)
        instance = wasmtime.Instance(store, compiled(code), [])
        exports = instance.exports(store)
        memory = exports["memory"]
        in_ptr, out_ptr = exports["evald_input_ptr"](store), exports["evald_output_ptr"](store)
        seen = []
        for text in (b"17 * 23 + 91", b"2 ** 200", b"1 / 0", b"(((", b"1.5 * 3"):
            memory.write(store, text, in_ptr)
            result = exports[export](store, len(text))
            seen.append(bytes(memory.read(store, out_ptr, out_ptr + abs(result))))
        outputs.append(seen)
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == b"482"


# Globals of every kind of value a constant expression can give, mutable and not; evald_eval
# adds 1 to each mutable number and returns the i32 (before the add) and an i64 check.
GLOBALS_WAT = """
(module
  (memory (export "memory") 1)
  (global $a (mut i32) (i32.const 7))
  (global $b (mut i64) (i64.const -5))
  (global $c (mut f32) (f32.const 1.5))
  (global $d (mut f64) (f64.const -2.25))
  (global $k i32 (i32.const 100))
  (global $v (mut v128) (v128.const i32x4 1 2 3 4))
  (global $r (mut funcref) (ref.null func))
  (global $e (mut externref) (ref.null extern))
  (func $self (result i32) (i32.const 1))
  (elem declare func $self)
  (func (export "evald_abi_version") (result i32) (i32.const 1))
  (func (export "evald_input_ptr") (result i32) (i32.const 16))
  (func (export "evald_input_cap") (result i32) (i32.const 16))
  (func (export "evald_output_ptr") (result i32) (i32.const 32))
  (func (export "evald_output_cap") (result i32) (i32.const 16))
  (func (export "evald_eval") (param i32) (result i32) (local $seen i32)
    (local.set $seen (i32.add (global.get $a) (global.get $k)))
    (if (i64.ne (global.get $b) (i64.const -5)) (then (local.set $seen (i32.const -1))))
    (if (f32.ne (global.get $c) (f32.const 1.5)) (then (local.set $seen (i32.const -2))))
    (if (f64.ne (global.get $d) (f64.const -2.25)) (then (local.set $seen (i32.const -3))))
    (if (i32.ne (i32x4.extract_lane 3 (global.get $v)) (i32.const 4))
      (then (local.set $seen (i32.const -4))))
    (if (i32.eqz (ref.is_null (global.get $r))) (then (local.set $seen (i32.const -5))))
    (global.set $a (i32.add (global.get $a) (i32.const 1)))
    (global.set $b (i64.add (global.get $b) (i64.const 1)))
    (global.set $c (f32.add (global.get $c) (f32.const 1)))
    (global.set $d (f64.add (global.get $d) (f64.const 1)))
    (global.set $v (v128.const i32x4 0 0 0 0))
    (global.set $r (ref.func $self))
    (local.get $seen))
)
"""


def _calls(compiled: Compiler, wasm: bytes, export: str, times: int) -> list[object]:
    store = wasmtime.Store(compiled.engine)
    store.set_fuel(10**9)
    store.set_epoch_deadline(10**9)
    exports = wasmtime.Instance(store, compiled(wasm), []).exports(store)
    return [exports[export](store, 0) for _ in range(times)]


def test_the_fresh_wrapper_puts_every_mutable_global_back(compiled: Compiler) -> None:
    wasm = append_custom_section(wasmtime.wat2wasm(GLOBALS_WAT), MANIFEST_SECTION, manifest_bytes())
    rewritten = instrumented(wasm)
    assert FRESH_WRAPPER_EXPORT in {export.name for export in parse_module(rewritten).exports}
    # the plain wrapper keeps what the last call left (reuse); the fresh one starts anew
    assert _calls(compiled, rewritten, EVAL_WRAPPER_EXPORT, 3) == [107, -5, -5]
    assert _calls(compiled, rewritten, FRESH_WRAPPER_EXPORT, 3) == [107, 107, 107]


@pytest.mark.parametrize(
    ("fields", "body", "reason"),
    [
        ("(func $s) (start $s)", "", "start function"),
        ("(table $t 1 funcref)", "(table.set $t (i32.const 0) (ref.null func))", "table.set"),
        (
            "(table $t 1 funcref)",
            "(drop (table.grow $t (ref.null func) (i32.const 1)))",
            "table.grow",
        ),
        (
            "(table $t 1 funcref)",
            "(table.fill $t (i32.const 0) (ref.null func) (i32.const 1))",
            "table.fill",
        ),
        (
            "(table $t 2 funcref)",
            "(table.copy $t $t (i32.const 0) (i32.const 1) (i32.const 1))",
            "table.copy",
        ),
        (
            "(table $t 1 funcref) (elem $e func $f) (func $f)",
            "(table.init $t $e (i32.const 0) (i32.const 0) (i32.const 1))",
            "table.init",
        ),
        ("(elem $e func $f) (func $f)", "(elem.drop $e)", "elem.drop"),
        ('(data $d "xy")', "(data.drop $d)", "data.drop"),
    ],
)
def test_a_module_that_could_keep_state_elsewhere_gets_no_fresh_wrapper(
    fields: str, body: str, reason: str
) -> None:
    wat = (
        '(module (memory (export "memory") 1) '
        + fields
        + ' (func (export "evald_eval") (param i32) (result i32) '
        + body
        + " (i32.const 0)))"
    )
    wasm = wasmtime.wat2wasm(wat)
    info = parse_module(wasm)
    assert reason in reset_blocker(wasm, info)
    eval_index = next(e.index for e in info.exports if e.name == "evald_eval")
    rewritten = instrument_memory_grow(wasm, info, eval_index)
    assert rewritten is not None
    names = {export.name for export in parse_module(rewritten).exports}
    assert EVAL_WRAPPER_EXPORT in names and FRESH_WRAPPER_EXPORT not in names


def test_memory_init_without_data_drop_keeps_the_fresh_wrapper() -> None:
    wat = """(module (memory (export "memory") 1) (data $d "xy")
      (func (export "evald_eval") (param i32) (result i32)
        (memory.init $d (i32.const 0) (i32.const 0) (i32.const 2)) (i32.const 0)))"""
    wasm = wasmtime.wat2wasm(wat)
    assert reset_blocker(wasm, parse_module(wasm)) == ""
