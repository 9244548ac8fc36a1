"""The arithmetic of shared pools: a tenant's guaranteed share, borrowing only what no share
needs, slots given back (evald/daemon/_shares.py; the daemon-level attacks are in
test_shared_pools.py)."""

from __future__ import annotations

import pytest

from evald.contract import ErrorCode, EvaldError
from evald.daemon._shares import SharedPool, Slots


def _take(pool: SharedPool, tenant: str, count: int) -> int:
    taken = 0
    for _ in range(count):
        try:
            pool.take(tenant)
        except EvaldError as exc:
            assert exc.code is ErrorCode.QUOTA_EXCEEDED
            assert "max_things" in exc.message
            break
        taken += 1
    return taken


def test_a_tenant_borrows_only_what_no_share_needs() -> None:
    pool = SharedPool(10, ["a", "b", "c"], setting="max_things", what="things")
    assert pool.share == 3
    # Alone, a gets its 3 and the one slot no guarantee covers (10 - 3 * 3).
    assert _take(pool, "a", 10) == 4
    # Every other tenant still gets its whole share, and no more while a holds the spare one.
    assert _take(pool, "b", 10) == 3
    assert _take(pool, "c", 10) == 3
    # A borrowed slot given back is there for whoever needs it next.
    pool.give("a")
    assert pool.held("a") == 3
    assert _take(pool, "c", 10) == 1
    assert _take(pool, "a", 10) == 0


def test_a_guaranteed_slot_given_back_is_the_tenants_again() -> None:
    pool = SharedPool(4, ["a", "b"], setting="max_things", what="things")
    assert _take(pool, "a", 4) == 2
    pool.give("a")
    assert _take(pool, "b", 4) == 2
    assert _take(pool, "a", 4) == 1


def test_more_tenants_than_slots_still_gives_each_one() -> None:
    pool = SharedPool(2, ["a", "b", "c"], setting="max_things", what="things")
    assert [_take(pool, name, 5) for name in "abc"] == [1, 1, 1]


def test_slots_refuse_typed_past_their_capacity() -> None:
    slots = Slots(2, setting="open_things", what="things")
    slots.take()
    slots.take()
    with pytest.raises(EvaldError) as refused:
        slots.take()
    assert refused.value.code is ErrorCode.UNAVAILABLE
    assert "open_things" in refused.value.message
    slots.give()
    slots.take()
