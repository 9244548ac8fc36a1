"""Fresh isolation for a call that grows the guest's memory: the instance is kept and put back
(the pages above the image zeroed, the guest's memory size a new instance's), the growth is
charged to the pool key, and the memory cap refuses exactly what it refuses a new instance."""

from __future__ import annotations

import pytest
import wasmtime

from evald.contract import MANIFEST_SECTION, ErrorCode, append_custom_section
from evald.host import HostConfig, Limits, WasmHost
from evald.host._memory_reset import memory_reset_unavailable
from evald.testing import PAGE, arg, guest, manifest_bytes

pytestmark = pytest.mark.skipif(
    bool(memory_reset_unavailable()), reason=memory_reset_unavailable() or "available"
)

#: Grows its memory by one page each call and answers (one digit each) the memory size it
#: starts with and the page number ``memory.grow`` returned, then what the first and the last
#: 16 bytes of that new page hold; then writes its input (the secret) to both places.
_SECRET_WAT = """
(module
  (memory (export "memory") 2)
  (func (export "evald_abi_version") (result i32) (i32.const 1))
  (func (export "evald_input_ptr") (result i32) (i32.const 16))
  (func (export "evald_input_cap") (result i32) (i32.const 16))
  (func (export "evald_output_ptr") (result i32) (i32.const 1024))
  (func (export "evald_output_cap") (result i32) (i32.const 64))
  (func (export "evald_eval") (param $n i32) (result i32) (local $page i32) (local $at i32)
    (i32.store8 (i32.const 1024) (i32.add (i32.const 48) (memory.size)))
    (local.set $page (memory.grow (i32.const 1)))
    (if (i32.eq (local.get $page) (i32.const -1)) (then (unreachable)))
    (i32.store8 (i32.const 1025) (i32.add (i32.const 48) (local.get $page)))
    (local.set $at (i32.mul (local.get $page) (i32.const 65536)))
    (memory.copy (i32.const 1026) (local.get $at) (i32.const 16))
    (memory.copy (i32.const 1042) (i32.add (local.get $at) (i32.const 65520)) (i32.const 16))
    (memory.copy (local.get $at) (i32.const 16) (local.get $n))
    (memory.copy (i32.add (local.get $at) (i32.const 65520)) (i32.const 16) (local.get $n))
    (i32.const 34))
)
"""
_NOTHING_SEEN = "\0" * 32


def _secret_module() -> bytes:
    return append_custom_section(
        bytes(wasmtime.wat2wasm(_SECRET_WAT)), MANIFEST_SECTION, manifest_bytes()
    )


@pytest.mark.parametrize("allocator", ["pooling", "default"])
def test_a_secret_written_in_grown_memory_is_gone_for_the_next_call(allocator: str) -> None:
    with WasmHost(HostConfig(isolation="fresh", allocator=allocator)) as host:
        module = host.load(_secret_module())
        assert module.resettable
        for secret in (b"first secret 16b", b"second secret 16", b"third secret 16b"):
            answer = host.evaluate(module, secret, Limits(), pool_key="s").value
            # a new instance's size (2 pages), its grow's answer (page 2), nothing written
            assert answer == "22" + _NOTHING_SEEN, (allocator, answer)
            assert host.cached_bytes("s") == 3 * PAGE  # kept, grown, and charged as grown
    with WasmHost(HostConfig(isolation="reuse", allocator=allocator)) as reused:  # the control
        module = reused.load(_secret_module())
        answers = [reused.evaluate(module, b"x", Limits(), pool_key="s").value for _ in range(3)]
        assert [answer and answer[:2] for answer in answers] == ["22", "33", "44"]


def test_a_grown_instance_is_kept_and_charged_its_size() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        grow = host.load(guest("grow"))  # 1 page at start
        assert grow.resettable
        assert host.evaluate(grow, arg(1), Limits(), pool_key="g").ok
        assert host.cached_bytes("g") == 2 * PAGE  # kept, not dropped
        assert host.evaluate(grow, arg(0), Limits(), pool_key="g").ok
        assert host.cached_bytes("g") == 2 * PAGE  # the memory keeps its pages, zeroed
        assert host.evaluate(grow, arg(3), Limits(), pool_key="g").ok  # 1 + 3: grows by 2
        assert host.cached_bytes("g") == 4 * PAGE


def test_a_grown_instance_over_the_keys_budget_serves_its_call_and_goes() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        grow = host.load(guest("grow"))
        limits = Limits(instance_cache_bytes=3 * PAGE)
        assert host.evaluate(grow, arg(1), limits, pool_key="b").ok
        assert host.cached_bytes("b") == 2 * PAGE
        assert host.evaluate(grow, arg(4), limits, pool_key="b").ok  # 5 pages: over the budget
        assert host.cached_bytes("b") == 0
        assert host.evaluate(grow, arg(1), limits, pool_key="b").ok
        assert host.cached_bytes("b") == 2 * PAGE


def test_the_memory_cap_refuses_what_it_refuses_a_new_instance() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        grow = host.load(guest("grow"))  # 1 page at start; traps when a grow is refused
        cap = Limits(memory_bytes=12 * PAGE)
        assert host.evaluate(grow, arg(10), cap, pool_key="c").ok  # 11 pages
        assert host.evaluate(grow, arg(10), cap, pool_key="c").ok  # fits the pages it has
        assert host.evaluate(grow, arg(11), cap, pool_key="c").ok  # 12: the memory grows by 1
        assert host.cached_bytes("c") == 12 * PAGE
        refused = host.evaluate(grow, arg(12), cap, pool_key="c")  # 13 pages from a new one
        assert refused.error is ErrorCode.MEMORY_LIMIT
        assert host.evaluate(grow, arg(11), cap, pool_key="c").ok
        # a lower cap: the kept 12-page instance is not used; a new one starts under the cap
        lower = Limits(memory_bytes=5 * PAGE)
        assert host.evaluate(grow, arg(4), lower, pool_key="c").ok
        assert host.cached_bytes("c") == 5 * PAGE
        assert host.evaluate(grow, arg(5), lower, pool_key="c").error is ErrorCode.MEMORY_LIMIT
