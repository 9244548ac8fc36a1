"""The raw ctypes call path: its contract checks, its results, traps, and GIL release."""

from __future__ import annotations

import threading
import time

import pytest
import wasmtime

from evald.host import _fastcall as fast

WAT = """
(module
  (memory (export "memory") 1)
  (global $calls (mut i32) (i32.const 0))
  (func (export "add1") (param i32) (result i32) (i32.add (local.get 0) (i32.const 1)))
  (func (export "sum3") (param i32 i32 i32) (result i32)
    (i32.add (i32.add (local.get 0) (local.get 1)) (local.get 2)))
  (func (export "count") (result i32)
    (global.set $calls (i32.add (global.get $calls) (i32.const 1))) (global.get $calls))
  (func (export "spin") (result i32) (loop $l (br $l)) (i32.const 0))
  (func (export "trap") (result i32) (unreachable))
  (func (export "wide") (param i64) (result i64) (local.get 0))
)
"""


@pytest.fixture(scope="module")
def engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    config.consume_fuel = True
    config.epoch_interruption = True
    return wasmtime.Engine(config)


@pytest.fixture(scope="module")
def module(engine: wasmtime.Engine) -> wasmtime.Module:
    return wasmtime.Module(engine, wasmtime.wat2wasm(WAT))


def _instance(
    engine: wasmtime.Engine, module: wasmtime.Module
) -> tuple[wasmtime.Store, wasmtime.Instance]:
    store = wasmtime.Store(engine)
    store.set_fuel(10**9)
    store.set_epoch_deadline(10**9)
    return store, wasmtime.Instance(store, module, [])


def _func(store: wasmtime.Store, instance: wasmtime.Instance, name: str) -> wasmtime.Func:
    item = fast.export(store, instance, name)
    assert isinstance(item, wasmtime.Func)
    return item


def test_call_returns_the_i32_result_wrapped_like_wasm(engine, module) -> None:
    store, instance = _instance(engine, module)
    add1 = fast.RawFunc.bind(store, _func(store, instance, "add1"), params=1, results=1)
    assert add1(41) == 42
    assert add1.call1(-5) == -4
    assert add1.call1(2**31 - 1) == -(2**31)  # i32 wrap-around, signed result
    sum3 = fast.RawFunc.bind(store, _func(store, instance, "sum3"), params=3, results=1)
    assert sum3(1, 20, 300) == 321


def test_calls_reach_the_same_instance_state(engine, module) -> None:
    store, instance = _instance(engine, module)
    count = fast.RawFunc.bind(store, _func(store, instance, "count"), params=0, results=1)
    assert [count.call0() for _ in range(3)] == [1, 2, 3]
    # the high-level path sees the state the raw path changed
    assert _func(store, instance, "count")(store) == 4


def test_bind_checks_arity_and_types(engine, module) -> None:
    store, instance = _instance(engine, module)
    with pytest.raises(TypeError, match=r"expected \(\) -> \(i32\)"):
        fast.RawFunc.bind(store, _func(store, instance, "add1"), params=0, results=1)
    with pytest.raises(TypeError, match="has type"):
        fast.RawFunc.bind(store, _func(store, instance, "wide"), params=1, results=1)
    memory = fast.export(store, instance, "memory")
    with pytest.raises(TypeError, match="not a function"):
        fast.RawFunc.bind(store, memory, params=0, results=1)  # type: ignore[arg-type]


def test_call_checks_the_argument_count(engine, module) -> None:
    store, instance = _instance(engine, module)
    add1 = fast.RawFunc.bind(store, _func(store, instance, "add1"), params=1, results=1)
    with pytest.raises(TypeError, match="takes 1 arguments"):
        add1()
    with pytest.raises(TypeError):
        add1.call0()


def test_a_function_of_another_store_is_refused_not_aborted(engine, module) -> None:
    # wasmtime aborts the process when an object is used with the wrong store; the binding
    # must refuse before any foreign call.
    store, instance = _instance(engine, module)
    other, _ = _instance(engine, module)
    func = _func(store, instance, "add1")
    with pytest.raises(wasmtime.WasmtimeError, match="another store"):
        fast.RawFunc.bind(other, func, params=1, results=1)
    with pytest.raises(wasmtime.WasmtimeError, match="another store"):
        fast.RawFunc.bind(other, func, params=1, results=1, type_checked=True)
    with pytest.raises(wasmtime.WasmtimeError, match="another store"):
        fast.export(other, instance, "add1")
    memory = fast.export(store, instance, "memory")
    assert isinstance(memory, wasmtime.Memory)
    with pytest.raises(wasmtime.WasmtimeError, match="another store"):
        fast.RawMemory(other, memory)


def test_export_lookup(engine, module) -> None:
    store, instance = _instance(engine, module)
    assert isinstance(fast.export(store, instance, "memory"), wasmtime.Memory)
    assert isinstance(fast.export(store, instance, "add1"), wasmtime.Func)
    assert fast.export(store, instance, "missing") is None


def test_a_trap_raises_trap_with_its_code(engine, module) -> None:
    store, instance = _instance(engine, module)
    trap = fast.RawFunc.bind(store, _func(store, instance, "trap"), params=0, results=1)
    with pytest.raises(wasmtime.Trap) as caught:
        trap.call0()
    assert caught.value.trap_code is wasmtime.TrapCode.UNREACHABLE
    assert not isinstance(caught.value, wasmtime.WasmtimeError)


def test_fuel_helpers_meter_a_call(engine, module) -> None:
    store, instance = _instance(engine, module)
    context = fast.RawStore(store)
    spin = fast.RawFunc.bind(store, _func(store, instance, "spin"), params=0, results=1)
    context.set_fuel(1000)
    assert context.fuel() == 1000
    with pytest.raises(wasmtime.Trap) as caught:
        spin.call0()
    assert caught.value.trap_code is wasmtime.TrapCode.OUT_OF_FUEL
    assert context.fuel() == 0
    add1 = fast.RawFunc.bind(store, _func(store, instance, "add1"), params=1, results=1)
    context.set_fuel(1000)
    add1.call1(1)
    assert 0 < 1000 - context.fuel() < 20


def test_the_call_releases_the_gil(engine, module) -> None:
    # The guest spins until the epoch passes its deadline, and only this thread advances the
    # epoch: if the foreign call held the GIL this thread could never run and the guest would
    # spin forever (the pytest timeout would fail the test).
    store, instance = _instance(engine, module)
    context = fast.RawStore(store)
    spin = fast.RawFunc.bind(store, _func(store, instance, "spin"), params=0, results=1)
    context.set_fuel(2**63)
    context.set_epoch_deadline(3)
    outcome: list[object] = []

    def run() -> None:
        try:
            spin.call0()
        except wasmtime.Trap as trap:
            outcome.append(trap.trap_code)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.05)
    assert thread.is_alive() and not outcome  # still spinning: the deadline is not reached
    for _ in range(3):
        engine.increment_epoch()
    thread.join(timeout=10)
    assert outcome == [wasmtime.TrapCode.INTERRUPT]


def test_raw_memory_reads_writes_and_checks_bounds(engine, module) -> None:
    store, instance = _instance(engine, module)
    exported = fast.export(store, instance, "memory")
    assert isinstance(exported, wasmtime.Memory)
    memory = fast.RawMemory(store, exported)
    assert memory.size() == 65536
    memory.write(100, b"hello")
    assert memory.read(99, 7) == b"\0hello\0"
    assert bytes(exported.read(store, 100, 105)) == b"hello"  # same bytes as wasmtime-py sees
    memory.fill(101, 3)
    assert memory.read(100, 5) == b"h\0\0\0o"
    assert memory.read(0, 0) == b""
    with pytest.raises(IndexError):
        memory.write(65534, b"abc")
    with pytest.raises(IndexError):
        memory.read(-1, 2)
    with pytest.raises(IndexError):
        memory.fill(0, 65537)
    exported.grow(store, 1)
    assert memory.size() == 2 * 65536
    memory.write(65536 + 10, b"x")  # the grown part is reachable
    assert memory.read(65536 + 10, 1) == b"x"


def test_instantiate_learns_the_store_id(engine, module) -> None:
    store = wasmtime.Store(engine)
    instance = fast.instantiate(store, wasmtime.Linker(engine).instantiate_pre(module))
    assert fast.store_id(store) == instance._instance.store_id
    other = wasmtime.Store(engine)
    with pytest.raises(wasmtime.WasmtimeError, match="another store"):
        fast.export(other, instance, "add1")


def test_raw_memory_zeroes_several_ranges_and_checks_them_all(engine, module) -> None:
    store, instance = _instance(engine, module)
    exported = fast.export(store, instance, "memory")
    assert isinstance(exported, wasmtime.Memory)
    memory = fast.RawMemory(store, exported)
    memory.write(0, b"abcdefgh")
    memory.zero((1, 2), (5, 1), (7, 0))
    assert memory.read(0, 8) == b"a\0\0de\0gh"
    with pytest.raises(IndexError):
        memory.zero((0, 1), (65535, 2))
    assert memory.read(0, 1) == b"a"  # nothing was zeroed when one range was out of bounds


def test_raw_memory_view_is_the_memory_until_it_grows(engine, module) -> None:
    store, instance = _instance(engine, module)
    exported = fast.export(store, instance, "memory")
    assert isinstance(exported, wasmtime.Memory)
    memory = fast.RawMemory(store, exported)
    view = memory.view()
    assert len(view) == memory.size() == 65536
    view[200:205] = b"world"
    assert memory.read(200, 5) == b"world"  # writes through the view land in guest memory
    memory.write(300, b"abc")
    assert bytes(view[300:303]) == b"abc"  # and the view sees writes made another way
    exported.grow(store, 2)
    grown = memory.view()
    assert len(grown) == 3 * 65536  # a new view covers the grown memory
    grown[65536 * 3 - 1] = 7
    assert memory.read(65536 * 3 - 1, 1) == b"\x07"
    assert bytes(grown[200:205]) == b"world"
