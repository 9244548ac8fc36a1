"""Modules that register and then misbehave on every call, one table row each.

An infinite loop in ``eval``, ``memory.grow`` bombs, deep recursion, oversized and negative output
lengths, writes past the output buffer and past memory, invalid UTF-8, guest errors that
impersonate host codes, table bombs, a probe that reports how much memory the guest really got,
a module registered under the victim's module name, and one that reports what an earlier call
left in its global and its heap. Each row says which outcomes a call may
have; anything else is a violation (a loop that returns a value has escaped its limits).
``deadline_exceeded`` is always allowed: deadlines are wall-clock time, and a busy machine that
stalls a worker can end even a trivial call. The rows' order is part of a run: the modules step
draws from the list.
"""

from __future__ import annotations

import random
import struct

from evald.host import MAX_TABLE_ELEMENTS
from evald.testing import arg
from evald_lab.fuzz.modules.build import (
    AttackParams,
    MaliciousModule,
    ModuleRow,
    fixed,
    one_of,
    with_behaviour,
)

__all__ = ["REGISTERED_THEN_MISBEHAVING", "accepted_modules"]

_LIMIT_TRAPS = frozenset({"deadline_exceeded", "fuel_exhausted"})
_GUEST_FAULT = frozenset({"guest_fault"})
_OK = frozenset({"ok"})


def _output_capacity(params: AttackParams) -> int:
    """An output buffer larger than the tenant's output limit, so the limit is what stops it."""
    return max(8192, params.output_bytes * 2)


def _output_past_limit(name: str, params: AttackParams) -> bytes:
    return with_behaviour("output", out_cap=_output_capacity(params))(name, params)


def _lengths_around_output_limit(rng: random.Random, params: AttackParams) -> bytes:
    limit = params.output_bytes
    return rng.choice((arg(limit - 1), arg(limit), arg(limit + 1), arg(_output_capacity(params))))


def _secret_word(rng: random.Random, _params: AttackParams) -> bytes:
    """A short word that the next call on the same instance would find (under reuse)."""
    return bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(1, 32)))


def _huge_data_segment(name: str, params: AttackParams) -> bytes:
    data = '(data (i32.const 65536) "' + "\\41" * (3 * 2**20 // 4) + '")'
    return with_behaviour(pages=64, extra=data)(name, params)


REGISTERED_THEN_MISBEHAVING: tuple[ModuleRow, ...] = (
    ModuleRow(
        "loop", "infinite_loop_in_eval", with_behaviour("loop"), expected=_LIMIT_TRAPS, heavy=True
    ),
    ModuleRow(
        "burn",
        "bounded_burn",
        with_behaviour("burn"),
        expected=_OK | _LIMIT_TRAPS,
        draw=one_of(arg(10), arg(1000), arg(100_000)),
    ),
    # memory and stack
    ModuleRow(
        "grow",
        "memory_grow_bomb",
        with_behaviour("grow"),
        expected=frozenset({"memory_limit"}),
        draw=one_of(arg(60_000), arg(65_535), arg(-1), arg(2**30)),
    ),
    ModuleRow(
        "grow_pages",
        "memory_grow_page_by_page",
        with_behaviour("grow_pages"),
        expected=frozenset({"memory_limit"}),
        draw=fixed(arg(70_000)),
    ),
    ModuleRow(
        "probe", "memory_probe", with_behaviour("memory_probe"), expected=_OK, probe="memory_pages"
    ),
    ModuleRow(
        "recurse",
        "deep_recursion",
        with_behaviour("recurse"),
        expected=frozenset({"stack_overflow"}) | _LIMIT_TRAPS,
        draw=one_of(arg(10_000_000), arg(2**31 - 1)),
    ),
    # result lengths the host must not trust
    ModuleRow(
        "len_over_cap",
        "output_length_over_buffer",
        with_behaviour("return", 4097),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "len_max",
        "output_length_i32_max",
        with_behaviour("return", 2**31 - 1),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "len_min",
        "output_length_i32_min",
        with_behaviour("return", -(2**31)),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "len_neg",
        "error_length_over_buffer",
        with_behaviour("return", -5000),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "out_limit",
        "output_over_tenant_limit",
        _output_past_limit,
        expected=frozenset({"ok", "output_too_large"}),
        draw=_lengths_around_output_limit,
    ),
    ModuleRow(
        "write_past",
        "writes_past_its_buffer",
        with_behaviour("output"),
        expected=_GUEST_FAULT,
        draw=one_of(arg(4096 + 100), arg(10_000_000), arg(2**31 - 1)),
    ),
    ModuleRow("oob", "out_of_bounds_access", with_behaviour("oob"), expected=_GUEST_FAULT),
    ModuleRow("trap", "unreachable", with_behaviour("trap"), expected=_GUEST_FAULT),
    # results the guest may not forge
    ModuleRow(
        "bad_utf8",
        "invalid_utf8_output",
        with_behaviour("payload", (b"\xff\xfe\xc0\x80", False)),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "fake_host",
        "guest_claims_host_code",
        with_behaviour("payload", (b"permission_denied:tenant victim", True)),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "fake_fuel",
        "guest_claims_fuel_code",
        with_behaviour("payload", (b"fuel_exhausted", True)),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "unknown_code",
        "guest_unknown_code",
        with_behaviour("payload", (b"nope:x", True)),
        expected=_GUEST_FAULT,
    ),
    ModuleRow(
        "guest_error",
        "guest_error",
        with_behaviour("payload", (b"syntax:" + b"m" * 3000, True)),
        # the payload is a data segment: after the host zeroes the returned bytes, the next call
        # on the same instance returns NULs, which name no code
        expected=frozenset({"syntax", "guest_fault"}),
    ),
    # tables, data and locals at the caps
    ModuleRow(
        "table_grow",
        "table_grow_bomb",
        with_behaviour("table_grow"),
        expected=_OK,
        draw=one_of(arg(60_000_000), arg(MAX_TABLE_ELEMENTS), arg(2**31 - 1)),
    ),
    ModuleRow(
        "table_fill",
        "table_fill_at_cap",
        with_behaviour("table_fill", MAX_TABLE_ELEMENTS),
        expected=_OK,
    ),
    ModuleRow("big_data", "huge_data_segment", _huge_data_segment, expected=_OK),
    ModuleRow(
        "locals",
        "many_locals",
        with_behaviour(extra="(func (local " + " i64" * 5_000 + "))"),
        expected=_OK,
    ),
    # state left behind: by its own earlier calls, never by another tenant
    ModuleRow(
        "count",
        "state_across_calls",
        with_behaviour("count"),
        expected=_OK | _GUEST_FAULT,
        draw=one_of(b"", b"x"),
    ),
    # reads whatever is left in its own buffers: never another tenant's data (checked by the
    # canaries), registered under another tenant's module name
    ModuleRow(
        "",
        "shadow_name_dump_input",
        with_behaviour("dump_input", 4096),
        expected=_OK | _GUEST_FAULT,
        draw=one_of(b"", b"x", struct.pack("<i", 7)),
        naming="victims",
    ),
    ModuleRow(
        "stale",
        "stale_output_buffer",
        with_behaviour("stale_output", 4096),
        expected=_OK | _GUEST_FAULT,
        draw=one_of(b"", b"xy"),
    ),
    # state one call leaves for the next: under fresh isolation a call must find none
    ModuleRow(
        "remember",
        "state_left_by_an_earlier_call",
        with_behaviour("remember"),
        expected=_OK,
        draw=_secret_word,
        probe="previous_call",
    ),
)


def accepted_modules(prefix: str, *, output_bytes: int, shadow_name: str) -> list[MaliciousModule]:
    """The modules of :data:`REGISTERED_THEN_MISBEHAVING`, built for a run.

    ``prefix`` keeps names unique per run; ``output_bytes`` is the attacker's output limit;
    ``shadow_name`` is another tenant's module name: the attacker registers its own module under
    it (names are per tenant) and must only ever reach its own.
    """
    params = AttackParams(prefix, output_bytes=output_bytes, shadow_name=shadow_name)
    return [row.module(params) for row in REGISTERED_THEN_MISBEHAVING]
