"""MemoryReset, the unsafe half of fresh isolation: after any writes, every byte of the memory is
what a new instance has, checked byte for byte against a second, untouched instance."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import wasmtime

from evald.host import HostConfig
from evald.host import _fastcall as fast
from evald.host import _memory_reset as page_reset
from evald.host._engine import make_engine_config

pytestmark = pytest.mark.skipif(
    bool(page_reset.memory_reset_unavailable()),
    reason=page_reset.memory_reset_unavailable() or "available",
)

PAGES = 40  # wasm pages: 2.5 MiB, 640 host pages
WASM_PAGE = 65536
# An image with data in three places (one crossing a host page boundary), and functions to
# write bytes at any address, read one, and grow the memory.
WAT = f"""
(module
  (memory (export "memory") {PAGES})
  (data (i32.const 100) "image at the start")
  (data (i32.const 8190) "across a page boundary")
  (data (i32.const 1048576) "\\01\\02\\03 in the middle")
  (func (export "poke") (param $at i32) (param $byte i32) (result i32)
    (i32.store8 (local.get $at) (local.get $byte)) (i32.const 0))
  (func (export "peek") (param $at i32) (result i32) (i32.load8_u (local.get $at)))
  (func (export "grow") (result i32) (memory.grow (i32.const 1)))
)
"""


@pytest.fixture(scope="module", params=["default", "pooling"])
def engine(request: pytest.FixtureRequest) -> wasmtime.Engine:
    pooling = request.param == "pooling"
    config = HostConfig(pool_instances=8, pool_memory_bytes=8 * 2**20)
    return wasmtime.Engine(make_engine_config(config, pooling=pooling))


@pytest.fixture(scope="module")
def pre(engine: wasmtime.Engine) -> wasmtime.InstancePre:
    return wasmtime.Linker(engine).instantiate_pre(wasmtime.Module(engine, wasmtime.wat2wasm(WAT)))


class Guest:
    def __init__(self, engine: wasmtime.Engine, pre: wasmtime.InstancePre) -> None:
        self.engine, self.pre = engine, pre
        self.store = wasmtime.Store(engine)
        self.store.set_fuel(10**12)
        self.store.set_epoch_deadline(10**9)
        self.instance = fast.instantiate(self.store, pre)
        exported = fast.export(self.store, self.instance, "memory")
        assert isinstance(exported, wasmtime.Memory)
        self.memory = fast.RawMemory(self.store, exported)
        self.poke, self.peek, self.grow = (
            fast.RawFunc.bind(self.store, self._func(name), params=params, results=1)
            for name, params in (("poke", 2), ("peek", 1), ("grow", 0))
        )

    def _func(self, name: str) -> wasmtime.Func:
        item = fast.export(self.store, self.instance, name)
        assert isinstance(item, wasmtime.Func)
        return item

    def contents(self) -> bytes:
        return bytes(self.memory.view())


@pytest.fixture(params=["native", "python"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native" and page_reset._NATIVE_RESET is None:
        pytest.skip("evald.host._reset is not built")
    return bool(request.param == "native")


def _reset_for(guest: Guest, native: bool) -> page_reset.MemoryReset:
    """A reset of ``guest``'s memory to what a new instance (a probe) has."""
    probe = Guest(guest.engine, guest.pre)
    return page_reset.MemoryReset(
        guest.memory, page_reset.pristine_pages(probe.memory), native=native
    )


@pytest.fixture
def guest(engine: wasmtime.Engine, pre: wasmtime.InstancePre) -> Guest:
    return Guest(engine, pre)


@pytest.fixture
def pristine(engine: wasmtime.Engine, pre: wasmtime.InstancePre) -> bytes:
    return Guest(engine, pre).contents()


def test_pristine_pages_are_exactly_the_non_zero_pages(guest: Guest, pristine: bytes) -> None:
    pages = page_reset.pristine_pages(guest.memory)
    page = page_reset.HOST_PAGE_BYTES
    assert [offset for offset, _ in pages] == [0, page, 2 * page, 1048576]
    rebuilt = bytearray(len(pristine))
    for offset, data in pages:
        rebuilt[offset : offset + len(data)] = data
    assert bytes(rebuilt) == pristine


@pytest.mark.parametrize("seed", range(6))
def test_after_any_writes_the_memory_is_a_new_instances(
    guest: Guest, pristine: bytes, seed: int, native: bool
) -> None:
    rng = random.Random(seed)
    reset = _reset_for(guest, native)
    size = PAGES * 65536
    for _round in range(4):
        # writes anywhere (image, zero region, page edges), reads that only map zero pages
        for _ in range(rng.randrange(1, 300)):
            guest.poke(rng.randrange(size), rng.randrange(256))
        for _ in range(50):
            guest.peek(rng.randrange(size))
        guest.poke(size - 1, 0xFF)  # the last byte
        guest.poke(0, 0xAA)  # the first
        guest.memory.write(1048576, b"\0\0\0")  # an image page turned to zeros by the host
        assert guest.contents() != pristine
        reset.reset()
        assert guest.contents() == pristine


def test_more_regions_than_one_scan_returns_are_all_reset(
    guest: Guest, pristine: bytes, native: bool
) -> None:
    reset = _reset_for(guest, native)
    page = page_reset.HOST_PAGE_BYTES
    for index in range(0, 600, 2):  # 300 separate written pages: ten scans of 32 regions
        guest.poke(index * page + 7, 1)
    reset.reset()
    assert guest.contents() == pristine


def test_an_untouched_memory_stays_as_it_is(guest: Guest, pristine: bytes, native: bool) -> None:
    reset = _reset_for(guest, native)
    assert reset.reset() >= 0
    assert guest.contents() == pristine


def test_a_reset_page_stays_resident_and_is_reset_again(
    guest: Guest, pristine: bytes, native: bool
) -> None:
    reset = _reset_for(guest, native)
    guest.poke(300_000, 9)
    first = reset.reset()
    assert first >= page_reset.HOST_PAGE_BYTES  # the written page was found
    guest.poke(300_000, 9)
    assert reset.reset() >= first  # still found (resident), and written back
    assert guest.contents() == pristine


def test_pristine_pages_must_be_sorted_aligned_and_inside(guest: Guest) -> None:
    page = page_reset.HOST_PAGE_BYTES
    data = bytes(page)
    for bad in ([(page, data), (0, data)], [(10, data)], [(PAGES * 65536, data)]):
        with pytest.raises(ValueError):
            page_reset.MemoryReset(guest.memory, bad)


def _forked_child_resets(pooling: bool, native: bool) -> int:
    """The forked-child scenario; returns 0 where it held, else a code :data:`FORK_FAILURES` names.

    The parent's pages are resident and mapped when it forks; the child writes its own copy of
    the memory and resets it through its own pagemap; the parent sees none of the child's writes.
    """
    config = HostConfig(pool_instances=8, pool_memory_bytes=8 * 2**20)
    engine = wasmtime.Engine(make_engine_config(config, pooling=pooling))
    pre = wasmtime.Linker(engine).instantiate_pre(wasmtime.Module(engine, wasmtime.wat2wasm(WAT)))
    guest, pristine = Guest(engine, pre), Guest(engine, pre).contents()
    reset = _reset_for(guest, native)
    guest.poke(500_000, 3)
    reset.reset()  # the parent's pages are now resident and mapped
    pid = os.fork()
    if pid == 0:  # the child: its own copy of the memory, its own pagemap
        try:
            guest.poke(700_000, 5)
            guest.poke(100, 0)
            reset.reset()
            os._exit(0 if guest.contents() == pristine else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    child = os.waitstatus_to_exitcode(status)
    if child != 0:
        return child if child > 0 else 4
    return 0 if guest.contents() == pristine else 3  # the child's writes never reached the parent


FORK_FAILURES = {
    1: "the child's reset left other bytes",
    2: "the child raised",
    3: "the parent saw the child's writes",
    4: "the child was killed by a signal",
}


@pytest.mark.parametrize("pooling", [False, True], ids=["default", "pooling"])
def test_a_forked_child_resets_with_its_own_page_tables(pooling: bool, native: bool) -> None:
    """In a new interpreter: this test process may hold gRPC channels, and a fork of it would run
    gRPC's fork handlers in the child (design.md §7, "A process that holds gRPC never forks")."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_memory_reset as t; "
        "sys.exit(t._forked_child_resets(sys.argv[2] == 'pooling', sys.argv[3] == 'native'))"
    )
    here = str(Path(__file__).parent)
    kinds = ("pooling" if pooling else "default", "native" if native else "python")
    run = subprocess.run(
        [sys.executable, "-c", script, here, *kinds], capture_output=True, text=True, timeout=120
    )
    failure = FORK_FAILURES.get(run.returncode, f"exit {run.returncode}")
    assert run.returncode == 0, f"{failure}\n{run.stdout}{run.stderr}"


def test_a_grown_memory_is_reset_over_its_whole_size(
    guest: Guest, pristine: bytes, native: bool
) -> None:
    reset = _reset_for(guest, native)
    assert guest.grow() == PAGES and guest.grow() == PAGES + 1
    grown = len(pristine) + 2 * WASM_PAGE
    for at in (100, len(pristine), len(pristine) + 5000, grown - 1):
        guest.poke(at, 0xA5)
    assert reset.follow(guest.memory)
    assert reset.size == grown
    reset.reset()
    assert guest.contents() == pristine + bytes(2 * WASM_PAGE)


def _resident(address: int) -> bool:
    """Whether the host page at ``address`` is present, by this process's page table."""
    page = page_reset.HOST_PAGE_BYTES
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // page * 8)
        return bool(int.from_bytes(pagemap.read(8), "little") >> 63)


def test_growth_past_the_resident_bytes_is_given_back(
    guest: Guest, pristine: bytes, native: bool
) -> None:
    reset = _reset_for(guest, native)
    grown_pages = page_reset.RESIDENT_GROWTH_BYTES // WASM_PAGE + 4
    for _ in range(grown_pages):
        assert guest.grow() != -1
    kept_at = len(pristine) + 1000  # inside the resident part
    given_at = len(pristine) + page_reset.RESIDENT_GROWTH_BYTES + 5000
    guest.poke(kept_at, 7)
    guest.poke(given_at, 9)
    assert reset.follow(guest.memory)
    reset.reset()
    base = guest.memory.base()
    assert _resident(base + kept_at)  # zeroed in place: the next call takes no fault on it
    assert not _resident(base + given_at)  # given back to the kernel
    assert guest.contents() == pristine + bytes(grown_pages * WASM_PAGE)


def test_a_reset_does_not_follow_another_memory(guest: Guest) -> None:
    reset = _reset_for(guest, True)
    other = Guest(guest.engine, guest.pre)
    assert other.grow() == PAGES
    assert not reset.follow(other.memory)  # another base: it would write where it must not
    assert reset.size == PAGES * WASM_PAGE
