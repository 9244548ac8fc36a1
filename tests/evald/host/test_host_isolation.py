"""Instance reuse and isolation: pool keys, discarding after traps, buffer zeroing, threads; and
fresh isolation: nothing of an earlier call, traps, modules it cannot put back, a full pool."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import wasmtime

from evald.contract import ErrorCode, EvaldError
from evald.host import MAX_TABLE_ELEMENTS, EvalOutcome, HostConfig, Limits, WasmHost
from evald.testing import PAGE, REMEMBERED_NOTHING, arg, guest, named_guest, remembered


@pytest.fixture(scope="module")
def host() -> Iterator[WasmHost]:
    with WasmHost(HostConfig(isolation="reuse")) as wasm_host:
        yield wasm_host


def values(outcomes: list[EvalOutcome]) -> list[str | None]:
    return [outcome.value for outcome in outcomes]


def test_reuse_keeps_one_instance_per_pool_key(host: WasmHost) -> None:
    count = host.load(guest("count"))
    limits = Limits()
    first = [host.evaluate(count, b"x", limits, pool_key="tenant-a") for _ in range(3)]
    assert values(first) == ["1", "2", "3"]
    other = host.evaluate(count, b"x", limits, pool_key="tenant-b")
    assert other.value == "1"  # another tenant never shares the instance
    assert host.evaluate(count, b"x", limits, pool_key="tenant-a").value == "4"


def test_an_instance_is_discarded_after_a_trap(host: WasmHost) -> None:
    count = host.load(guest("count"))
    assert values([host.evaluate(count, b"x", Limits(), pool_key="t") for _ in range(2)]) == [
        "1",
        "2",
    ]
    trapped = host.evaluate(count, b"", Limits(), pool_key="t")  # empty input traps
    assert trapped.error is ErrorCode.GUEST_FAULT
    assert host.evaluate(count, b"x", Limits(), pool_key="t").value == "1"  # a new instance


def test_an_instance_is_discarded_after_a_malformed_output(host: WasmHost) -> None:
    # "count" never returns a bad length, so use a module whose bad output follows state
    module = host.load(guest("return", -(2**31)))
    assert host.evaluate(module, b"", Limits(), pool_key="bad").error is ErrorCode.GUEST_FAULT
    assert host.evaluate(module, b"", Limits(), pool_key="bad").error is ErrorCode.GUEST_FAULT


def test_fresh_mode_instantiates_per_call() -> None:
    for allocator in ("pooling", "default"):
        with WasmHost(HostConfig(isolation="fresh", allocator=allocator)) as host:
            count = host.load(guest("count"))
            outcomes = [host.evaluate(count, b"x", Limits()) for _ in range(3)]
            assert values(outcomes) == ["1", "1", "1"], allocator


def test_reuse_zeroes_the_input_buffer(host: WasmHost) -> None:
    dump = host.load(guest("dump_input", 16))
    first = host.evaluate(dump, b"secret-data", Limits(), pool_key="z")
    assert first.value == "secret-data" + "\0" * 5
    second = host.evaluate(dump, b"", Limits(), pool_key="z")
    assert second.value == "\0" * 16  # the first call's input is gone


def test_reuse_zeroes_the_returned_output(host: WasmHost) -> None:
    stale = host.load(guest("stale_output", 8))
    assert host.evaluate(stale, b"abcdefgh", Limits(), pool_key="o").value == "xxxxxxxx"
    assert host.evaluate(stale, b"", Limits(), pool_key="o").value == "\0" * 8


def test_buffers_are_also_zeroed_after_a_guest_error(host: WasmHost) -> None:
    # a guest error is not a trap: the instance stays, so its buffers must be cleared too
    module = host.load(guest("dump_or_error", 12))
    failed = host.evaluate(module, b"e-secret", Limits(), pool_key="e")
    assert (failed.error, failed.message) == (ErrorCode.SYNTAX, "probe: syntax")
    after = host.evaluate(module, b"d", Limits(), pool_key="e")
    assert after.value == "d" + "\0" * 11  # not "d-secret"


def test_a_lower_memory_cap_for_the_same_key_takes_effect(host: WasmHost) -> None:
    grow = host.load(guest("grow"))
    big = Limits(memory_bytes=20 * PAGE)
    assert host.evaluate(grow, arg(10), big, pool_key="m").value == "ok"  # now 11 pages
    small = Limits(memory_bytes=5 * PAGE)
    # the live instance is larger than the new cap: a new one is made under the new cap
    assert host.evaluate(grow, arg(3), small, pool_key="m").value == "ok"
    assert host.evaluate(grow, arg(3), small, pool_key="m").error is ErrorCode.MEMORY_LIMIT


def test_a_later_trap_is_not_blamed_on_an_earlier_refused_grow(host: WasmHost) -> None:
    module = host.load(guest("grow_or_trap"))
    limits = Limits(memory_bytes=4 * PAGE)
    assert host.evaluate(module, b"g", limits, pool_key="flag").value == "ok"  # grow refused
    trapped = host.evaluate(module, b"t", limits, pool_key="flag")
    assert trapped.error is ErrorCode.GUEST_FAULT


def test_instances_per_thread_are_bounded() -> None:
    with WasmHost(HostConfig(isolation="reuse", instances_per_thread=2)) as host:
        count = host.load(guest("count"))
        for key in ("a", "b", "c"):
            assert host.evaluate(count, b"x", Limits(), pool_key=key).value == "1"
        assert host.evaluate(count, b"x", Limits(), pool_key="c").value == "2"  # kept
        assert host.evaluate(count, b"x", Limits(), pool_key="a").value == "1"  # evicted


def test_forget_drops_this_threads_instances(host: WasmHost) -> None:
    count = host.load(guest("count"))
    assert host.evaluate(count, b"x", Limits(), pool_key="f").value == "1"
    host.forget(count)
    assert host.evaluate(count, b"x", Limits(), pool_key="f").value == "1"


def test_two_threads_evaluate_at_once(host: WasmHost) -> None:
    echo = host.load(guest("echo"))
    burn = host.load(guest("burn"))
    count = host.load(guest("count"))
    barrier = threading.Barrier(2)

    def work(worker: int) -> list[tuple[str | None, str | None]]:
        barrier.wait()
        seen = []
        for i in range(200):
            text = f"worker {worker} call {i}"
            seen.append((host.evaluate(echo, text.encode(), Limits()).value, text))
            if i % 50 == 0:
                seen.append((host.evaluate(burn, arg(20_000), Limits()).value, "ok"))
        seen.append((host.evaluate(count, b"x", Limits(), pool_key="shared").value, "1"))
        return seen

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(work, range(2)))
    for seen in results:
        assert all(got == expected for got, expected in seen)
    # each thread had its own instance for the same pool key: both counted "1"


def test_two_deadlines_run_out_side_by_side(host: WasmHost) -> None:
    loop = host.load(guest("loop"))
    barrier = threading.Barrier(2)

    def run(_: int) -> EvalOutcome:
        barrier.wait()
        return host.evaluate(loop, b"", Limits(fuel=0, deadline_ms=100))

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(run, range(2)))
    assert [o.error for o in outcomes] == [ErrorCode.DEADLINE_EXCEEDED] * 2


def test_a_reused_instance_takes_a_new_memory_view_after_a_grow(host: WasmHost) -> None:
    # Copies go through a byte view of the guest memory; a call that grows the memory (which
    # may move it) must leave the instance with a view of the whole grown memory.
    grow = host.load(guest("grow"))
    limits = Limits(memory_bytes=40 * PAGE)
    for pages in (1, 3, 5):
        assert host.evaluate(grow, arg(pages), limits, pool_key="view").value == "ok"
        instance = host._pool.instances()["view", grow.sha256]
        assert instance.view_size == instance.memory.size() == len(instance.view)
    assert instance.view_size >= 10 * PAGE
    dump = host.load(guest("dump_input", 16))
    assert host.evaluate(dump, b"after", limits, pool_key="view").value == "after" + "\0" * 11


# -- fresh isolation -------------------------------------------------------------------------


@pytest.mark.parametrize("allocator", ["pooling", "default"])
def test_fresh_finds_nothing_of_an_earlier_call_within_and_across_pool_keys(allocator: str) -> None:
    with WasmHost(HostConfig(isolation="fresh", allocator=allocator)) as host:
        remember = host.load(guest("remember"))
        assert remember.resettable
        for key in ("a", "b", "a", "a", "b"):
            outcome = host.evaluate(remember, f"secret-{key}".encode(), Limits(), pool_key=key)
            assert outcome.value == REMEMBERED_NOTHING, (allocator, key, outcome)
        assert host.cached_bytes("a") > 0  # kept (and put back), not made per call


def test_reuse_finds_the_previous_call_of_its_pool_key_only() -> None:
    with WasmHost(HostConfig(isolation="reuse")) as host:
        remember = host.load(guest("remember"))
        assert host.evaluate(remember, b"first", Limits(), pool_key="a").value == REMEMBERED_NOTHING
        assert host.evaluate(remember, b"other", Limits(), pool_key="b").value == REMEMBERED_NOTHING
        assert host.evaluate(remember, b"again", Limits(), pool_key="a").value == remembered(
            b"first"
        )


def test_a_trap_during_a_fresh_call_leaves_nothing_for_the_next() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        remember = host.load(guest("remember"))
        trapped = host.evaluate(remember, b"!kept before the trap", Limits(), pool_key="t")
        assert trapped.error is ErrorCode.GUEST_FAULT
        assert host.cached_bytes("t") == 0  # the trapped instance is gone
        after = host.evaluate(remember, b"x", Limits(), pool_key="t")
        assert after.value == REMEMBERED_NOTHING


def test_a_guest_error_in_fresh_mode_is_put_back_too() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        module = host.load(guest("dump_or_error", 12))
        failed = host.evaluate(module, b"e-secret", Limits(), pool_key="e")
        assert failed.error is ErrorCode.SYNTAX
        assert host.evaluate(module, b"", Limits(), pool_key="e").value == "\0" * 12


def test_a_module_that_cannot_be_put_back_gets_a_new_instance_per_call() -> None:
    # a start function sets the global: the fresh wrapper could not know its value
    wasm = guest("count", start="(global.set $count (i32.const 4))")
    with WasmHost(HostConfig(isolation="fresh")) as host:
        count = host.load(wasm)
        assert not count.resettable
        assert values([host.evaluate(count, b"x", Limits()) for _ in range(3)]) == ["5", "5", "5"]
        assert host.cached_bytes("") == 0  # nothing kept


def test_without_the_kernels_scan_fresh_instantiates_per_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from evald.host import _memory_reset

    monkeypatch.setattr(_memory_reset._PAGEMAP, "_probed", True)
    monkeypatch.setattr(_memory_reset._PAGEMAP, "error", "no PAGEMAP_SCAN (test)")
    with (
        caplog.at_level("WARNING", logger="evald.host"),
        WasmHost(HostConfig(isolation="fresh")) as host,
    ):
        warned = [r for r in caplog.records if "new instance for every call" in r.message]
        assert len(warned) == 1 and "no PAGEMAP_SCAN (test)" in warned[0].getMessage()
        remember = host.load(guest("remember"))
        answers = [host.evaluate(remember, b"secret", Limits()).value for _ in range(3)]
        assert answers == [REMEMBERED_NOTHING] * 3
        assert host.cached_bytes("") == 0


def test_a_full_instance_pool_drops_kept_instances_to_make_room() -> None:
    # 3 slots: the trial instance at load needs one while it lives; then kept instances of 5
    # pool keys compete for them, and the least recently used make room
    with WasmHost(HostConfig(isolation="fresh", pool_instances=3)) as host:
        remember = host.load(guest("remember"))
        for round_ in range(2):
            for key in "abcde":
                outcome = host.evaluate(remember, key.encode(), Limits(), pool_key=key)
                assert outcome.value == REMEMBERED_NOTHING, (round_, key, outcome)
        assert sum(host.cached_bytes(key) > 0 for key in "abcde") <= 3


def test_a_full_pool_with_nothing_to_drop_is_unavailable_not_a_crash() -> None:
    with WasmHost(HostConfig(isolation="fresh", pool_instances=1)) as host:
        remember = host.load(guest("remember"))
        kept, done = threading.Event(), threading.Event()

        def hold_the_only_slot() -> None:  # this thread's kept instance, alive until done
            assert host.evaluate(remember, b"x", Limits(), pool_key="x").ok
            kept.set()
            done.wait(30)

        holder = threading.Thread(target=hold_the_only_slot)
        holder.start()
        assert kept.wait(30)
        refused = host.evaluate(remember, b"y", Limits(), pool_key="y")
        assert refused.error is ErrorCode.UNAVAILABLE, refused
        assert "pool_instances" in refused.message
        done.set()
        holder.join()  # the thread's instances go with it
        assert host.evaluate(remember, b"z", Limits(), pool_key="y").value == REMEMBERED_NOTHING


def test_a_module_larger_than_a_pool_slot_is_refused_at_load() -> None:
    with WasmHost(HostConfig(isolation="fresh", pool_memory_bytes=4 * PAGE)) as host:
        with pytest.raises(EvaldError):
            host.load(guest("echo", pages=5), limits=Limits(memory_bytes=64 * PAGE))
        assert host.load(guest("echo", pages=4)).manifest.name == "probe"


# -- a put-back instance is a new one, to the guest -------------------------------------------

_STATE_WAT = """
(module
  (memory (export "memory") 2)
  (data (i32.const 4096) "ORIGINAL")
  (func (export "evald_abi_version") (result i32) (i32.const 1))
  (func (export "evald_input_ptr") (result i32) (i32.const 16))
  (func (export "evald_input_cap") (result i32) (i32.const 64))
  (func (export "evald_output_ptr") (result i32) (i32.const 1024))
  (func (export "evald_output_cap") (result i32) (i32.const 64))
  ;; answers: memory size in pages (one digit), then the 8 bytes of the data segment; then
  ;; overwrites the segment with the input, and grows the memory on an input "g..."
  (func (export "evald_eval") (param $n i32) (result i32)
    (i32.store8 (i32.const 1024) (i32.add (i32.const 48) (memory.size)))
    (memory.copy (i32.const 1025) (i32.const 4096) (i32.const 8))
    (memory.copy (i32.const 4096) (i32.const 16) (local.get $n))
    (if (i32.eq (i32.load8_u (i32.const 16)) (i32.const 0x67))
      (then (drop (memory.grow (i32.const 1)))))
    (i32.const 9))
)
"""


def _state_module() -> bytes:
    from evald.contract import MANIFEST_SECTION, append_custom_section
    from evald.testing import manifest_bytes

    return append_custom_section(
        bytes(wasmtime.wat2wasm(_STATE_WAT)), MANIFEST_SECTION, manifest_bytes()
    )


def test_memory_size_and_data_segments_are_a_new_instances_after_any_call() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        module = host.load(_state_module())
        assert module.resettable
        answers = [
            host.evaluate(module, data, Limits(), pool_key="s").value
            for data in (b"overwritten", b"grow and overwrite", b"again", b"x")
        ]
        assert answers == ["2ORIGINAL"] * 4
    with WasmHost(HostConfig(isolation="reuse")) as reused:  # the control
        module = reused.load(_state_module())
        answers = [
            reused.evaluate(module, data, Limits(), pool_key="s").value
            for data in (b"overwritten", b"grow and overwrite", b"again")
        ]
        assert answers == ["2ORIGINAL", "2overwrit", "3grow and"]


def test_a_module_that_changes_a_table_gets_a_new_table_every_call() -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        grower = host.load(guest("table_grow"))
        assert not grower.resettable  # table.grow: run on a new instance per call
        data = arg(MAX_TABLE_ELEMENTS - 1)  # the table starts with 1 element: full after one
        assert [host.evaluate(grower, data, Limits()).value for _ in range(3)] == ["ok"] * 3
    with WasmHost(HostConfig(isolation="reuse")) as reused:
        grower = reused.load(guest("table_grow"))
        assert [reused.evaluate(grower, data, Limits()).value for _ in range(2)] == ["ok", "no"]


@pytest.mark.parametrize(
    ("limits", "code"),
    [
        (Limits(fuel=10**6), ErrorCode.FUEL_EXHAUSTED),
        (Limits(fuel=0, deadline_ms=5), ErrorCode.DEADLINE_EXCEEDED),
    ],
)
def test_a_call_ended_by_a_limit_leaves_no_instance_behind(limits: Limits, code: ErrorCode) -> None:
    with WasmHost(HostConfig(isolation="fresh")) as host:
        burn = host.load(guest("burn"))
        assert host.evaluate(burn, arg(10), Limits(), pool_key="d").value == "ok"
        assert host.cached_bytes("d") > 0
        ended = host.evaluate(burn, arg(2**31 - 1), limits, pool_key="d")
        assert ended.error is code
        assert host.cached_bytes("d") == 0  # discarded mid-call, never put back and reused
        assert host.evaluate(burn, arg(10), Limits(), pool_key="d").value == "ok"


@pytest.mark.parametrize("isolation", ["fresh", "reuse"])
def test_re_making_an_instance_another_key_pushed_out_is_not_its_keys_work(
    isolation: str,
) -> None:
    """With ``instances_per_thread = 8``, one tenant's calls over eight modules pushed another
    tenant's instance out, and re-making it was charged to the victim (it was marked heavy).
    The pool says how much of a call was such work; an instance a key pushes out of its own
    stays its own cost."""
    with WasmHost(HostConfig(isolation=isolation, instances_per_thread=8)) as host:  # type: ignore[arg-type]
        victim = host.load(named_guest("count", "victim"))
        churn = [host.load(named_guest("count", f"churn_{i}")) for i in range(9)]
        assert host.evaluate(victim, b"x", Limits(), pool_key="b").error is None
        assert host.take_uncharged_s() == 0.0  # its first instance is its own work
        for module in churn[:8]:  # eight of "a" push "b"'s one out
            assert host.evaluate(module, b"x", Limits(), pool_key="a").error is None
            host.take_uncharged_s()
        assert host.evaluate(victim, b"x", Limits(), pool_key="b").error is None
        assert host.take_uncharged_s() > 0.0  # "a" pushed it out: not "b"'s work
        assert host.take_uncharged_s() == 0.0  # counted once
        assert host.evaluate(victim, b"x", Limits(), pool_key="b").error is None
        assert host.take_uncharged_s() == 0.0  # kept: nothing re-made
        # "b" pushed one of "a"'s out in turn: re-made once, not "a"'s work; after that "a"
        # turning over its own nine modules pays for its own re-instantiations
        assert host.evaluate(churn[0], b"x", Limits(), pool_key="a").error is None
        assert host.take_uncharged_s() > 0.0
        for module in churn[1:]:
            assert host.evaluate(module, b"x", Limits(), pool_key="a").error is None
            host.take_uncharged_s()
        for _ in range(2):
            for module in churn:
                assert host.evaluate(module, b"x", Limits(), pool_key="a").error is None
                assert host.take_uncharged_s() == 0.0, module.manifest.name
