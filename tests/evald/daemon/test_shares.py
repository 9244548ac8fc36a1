"""The arithmetic of shared pools: a tenant's guaranteed share, borrowing only what no share
needs, slots given back (evald/daemon/_shares.py; the daemon-level attacks are in
test_shared_pools.py)."""

from __future__ import annotations

import pytest

from evald.contract import ErrorCode, EvaldError
from evald.daemon._data_path import choose_eviction
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


def test_the_capacity_is_a_hard_cap_even_with_more_tenants_than_slots() -> None:
    """Each tenant's minimum share of one once beat the cap: 40 tenants held 40 of 16 slots."""
    pool = SharedPool(2, ["a", "b", "c"], setting="max_things", what="things")
    assert [_take(pool, name, 5) for name in "abc"] == [1, 1, 0]
    pool.give("a")
    assert _take(pool, "c", 5) == 1  # each still holds one at most while others wait
    assert _take(pool, "a", 5) == 0


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


class _Waiting:
    def __init__(self, peer: tuple[int, int], accepted_at: float, *, heard: bool = True) -> None:
        self.peer: tuple[int, int] | None = peer
        self.accepted_at = accepted_at
        self.heard = heard


def test_the_peer_holding_most_unauthenticated_slots_pays_for_a_new_one() -> None:
    flood, client, other = (1, 1000), (2, 1000), (3, 1000)
    pool = [_Waiting(flood, t) for t in (1.0, 2.0, 3.0)] + [_Waiting(client, 0.5)]
    now = 3.1  # every connection within its 0.25 s grace
    # The flood's next connection evicts its own oldest, never the client's.
    assert choose_eviction(pool, flood, now, 0.25) is pool[0]
    # A client with fewer slots takes one from the flood.
    assert choose_eviction(pool, client, now, 0.25) is pool[0]
    assert choose_eviction(pool, other, now, 0.25) is pool[0]
    # Between equals a slot moves only from a connection past its grace or silent.
    equals = [_Waiting(flood, 3.0), _Waiting(client, 3.05)]
    assert choose_eviction(equals, other, now, 0.25) is None
    assert choose_eviction(equals, other, 3.27, 0.25) is equals[0]
    silent = [
        _Waiting(flood, 3.0),
        _Waiting(client, 2.0, heard=True),
        _Waiting(other, 3.05, heard=False),
    ]
    assert choose_eviction(silent, (4, 1000), now, 0.25) is silent[2]
