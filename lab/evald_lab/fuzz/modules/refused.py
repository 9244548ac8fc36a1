"""Modules the daemon must refuse at registration, one table row each.

An infinite loop, a ``memory.grow`` bomb or deep recursion in the start function, imports of
every kind, a memory or table above the caps, a data segment outside memory or past the module
cap, compile bombs (too many functions, locals or bytes of code; a function whose branches, or
locals times branches, cost the compiler gigabytes; one over the worker's memory limit), buffers
outside memory, bad manifests (among them input grammars and result regexes that can produce
``<``, and text no store can keep: a NUL, a lone surrogate), and bytes that are not a module at
all. The rows' order is part of a run: the modules step draws from the list.
"""

from __future__ import annotations

from evald.host import MAX_CODE_BYTES, MAX_FUNCTIONS, MAX_TABLE_ELEMENTS
from evald.testing import branchy_function, guest, manifest_bytes, padded
from evald_lab.fuzz.modules.build import (
    AttackParams,
    Builder,
    MaliciousModule,
    ModuleRow,
    Naming,
    echo_with_getter,
    module_manifest,
    with_behaviour,
)

__all__ = ["REFUSED_AT_REGISTRATION", "refused_modules"]

_INVALID_MODULE = frozenset({"invalid_module"})
_RECURSION = (
    "(func $down (param i32) (result i32) (call $down (i32.add (local.get 0) (i32.const 1))))"
)


def _refuse(
    label: str,
    family: str,
    build: Builder,
    *,
    codes: frozenset[str] = _INVALID_MODULE,
    naming: Naming = "prefixed",
) -> ModuleRow:
    return ModuleRow(label, family, build, refusal=codes, naming=naming)


def _memory_above_cap(name: str, params: AttackParams) -> bytes:
    return with_behaviour(pages=params.memory_bytes // 65536 + 1)(name, params)


def _over_module_cap(name: str, params: AttackParams) -> bytes:
    return padded(with_behaviour()(name, params), params.module_bytes + 1)


def _too_many_functions(name: str, params: AttackParams) -> bytes:
    functions = "".join(f"(func (result i32) (i32.const {i}))" for i in range(MAX_FUNCTIONS))
    return with_behaviour(extra=functions)(name, params)


def _too_many_locals(name: str, params: AttackParams) -> bytes:
    return with_behaviour(extra="(func (local " + " i64" * 50_001 + "))")(name, params)


def _branchy(locals_count: int, branches: int) -> Builder:
    """An echo module with one extra function of ``branches`` branches over ``locals_count``
    locals: compiling it costs memory with locals times branches."""
    return lambda name, params: with_behaviour(extra=branchy_function(locals_count, branches))(
        name, params
    )


def _too_much_code(name: str, params: AttackParams) -> bytes:
    return with_behaviour(extra="(func " + "nop " * (MAX_CODE_BYTES + 16) + ")")(name, params)


def _echo_with_manifest(**changes: object) -> Builder:
    """An echo module whose own manifest has ``changes``."""
    return lambda name, _params: guest("echo", manifest=module_manifest(name, **changes))


def _echo_with_raw_manifest(manifest: bytes | None, *, manifests: int = 1) -> Builder:
    """An echo module carrying ``manifest`` as given, ``manifests`` times."""
    return lambda _name, _params: guest("echo", manifest=manifest, manifests=manifests)


def _two_manifests(name: str, _params: AttackParams) -> bytes:
    return guest("echo", manifest=module_manifest(name), manifests=2)


def _raw(data: bytes) -> Builder:
    return lambda _name, _params: data


REFUSED_AT_REGISTRATION: tuple[ModuleRow, ...] = (
    # what the start function does runs at instantiation, before any limit of a call
    _refuse("start_loop", "infinite_loop_in_start", with_behaviour(start="(loop $l (br $l))")),
    _refuse(
        "start_grow",
        "memory_grow_bomb_in_start",
        with_behaviour(
            start="(if (i32.eq (memory.grow (i32.const 65535)) (i32.const -1)) "
            "(then (unreachable)))"
        ),
    ),
    _refuse(
        "start_recurse",
        "deep_recursion_in_start",
        with_behaviour(start="(drop (call $down (i32.const 0)))", extra=_RECURSION),
    ),
    # a guest reaches nothing outside itself
    _refuse(
        "import_func",
        "import_function",
        with_behaviour(imports='(import "env" "now" (func (result i64)))'),
    ),
    _refuse(
        "import_wasi",
        "import_wasi",
        with_behaviour(
            imports='(import "wasi_snapshot_preview1" "fd_write" '
            "(func (param i32 i32 i32 i32) (result i32)))"
        ),
    ),
    _refuse(
        "import_global", "import_global", with_behaviour(imports='(import "env" "g" (global i32))')
    ),
    _refuse(
        "import_table",
        "import_table",
        with_behaviour(imports='(import "env" "t" (table 1 funcref))'),
    ),
    _refuse(
        "import_memory", "import_memory", with_behaviour(imports='(import "env" "m" (memory 1))')
    ),
    # memory, data and tables over the caps
    _refuse("huge_memory", "memory_minimum_above_cap", _memory_above_cap),
    _refuse("max_memory", "memory_minimum_4gib", with_behaviour(pages=65536)),
    _refuse(
        "data_oob",
        "data_segment_outside_memory",
        with_behaviour(extra='(data (i32.const 16777216) "boom")'),
    ),
    _refuse("data_over_cap", "huge_data_segment_over_module_cap", _over_module_cap),
    _refuse("table_bomb", "table_above_cap", with_behaviour("table_fill", MAX_TABLE_ELEMENTS + 1)),
    _refuse("table_4g", "table_4g_elements", with_behaviour("table_fill", 4_294_967_295)),
    # compile bombs: compilation cannot be interrupted, so they are refused before it
    _refuse("many_funcs", "compile_bomb_functions", _too_many_functions),
    _refuse("many_locals", "compile_bomb_locals", _too_many_locals),
    _refuse("big_code", "compile_bomb_code_bytes", _too_much_code),
    # compile memory: one function of 20,000 branches over 2,000 locals (437 KB took a worker to
    # 1.85 GiB), the product alone, and a shape inside both caps that needs more than the fuzz
    # daemon's compile_memory_bytes (the worker's own limit refuses it)
    _refuse("branch_bomb", "compile_bomb_branches", _branchy(2_000, 20_000)),
    _refuse("local_branches", "compile_bomb_locals_times_branches", _branchy(2_000, 1_000)),
    _refuse("compile_memory", "compile_memory_over_limit", _branchy(100, 9_990)),
    # buffers the host would read or write outside the guest's memory
    _refuse(
        "out_ptr_oob",
        "output_pointer_outside_memory",
        echo_with_getter("evald_output_ptr", 0x7FFF_FFF0),
    ),
    _refuse("out_ptr_neg", "output_pointer_negative", echo_with_getter("evald_output_ptr", -16)),
    _refuse(
        "out_cap_huge",
        "output_capacity_past_memory",
        echo_with_getter("evald_output_cap", 0x7FFF_FFFF),
    ),
    _refuse("in_cap_zero", "input_capacity_zero", echo_with_getter("evald_input_cap", 0)),
    _refuse("buffers_oob", "buffer_outside_memory", with_behaviour(in_ptr=65536 - 16)),
    # the ABI and its exports
    _refuse("abi_two", "wrong_abi_version", with_behaviour(abi_version=2)),
    _refuse("no_eval", "missing_export", with_behaviour(omit=("evald_eval",))),
    _refuse(
        "bad_eval",
        "mistyped_export",
        with_behaviour(retype={"evald_eval": "(param i64) (result i32)"}),
    ),
    # manifests
    _refuse("no_manifest", "missing_manifest", _echo_with_raw_manifest(None, manifests=0)),
    _refuse("two_manifests", "two_manifests", _two_manifests),
    _refuse("json", "manifest_not_json", _echo_with_raw_manifest(b"{not json")),
    _refuse("huge_manifest", "manifest_over_64kib", _echo_with_manifest(description="x" * 70_000)),
    # text no store can keep (PostgreSQL refuses NUL and lone surrogates): a permanent refusal,
    # never `unavailable ... retry`
    _refuse("nul_manifest", "manifest_holds_nul", _echo_with_manifest(description="a\u0000b")),
    _refuse(
        "surrogate_manifest", "manifest_lone_surrogate", _echo_with_manifest(description="\ud800")
    ),
    _refuse(
        "calc_shadow",
        "reserved_name",
        _echo_with_raw_manifest(
            manifest_bytes(name="calc", tag="calc", semantics_version="calc/9")
        ),
        codes=frozenset({"invalid_argument"}),
        naming="exact",
    ),
    _refuse(
        "bad name",
        "manifest_bad_name",
        _echo_with_raw_manifest(manifest_bytes(name="Bad Name", tag="bad")),
        naming="exact",
    ),
    # not a module
    _refuse("not_wasm", "not_webassembly", _raw(b"\0asm\x01\0\0\0" + b"\xff" * 64)),
    _refuse("wat_text", "text_not_binary", _raw(b"(module (func))")),
    _refuse("empty", "empty_module", _raw(b"")),
    # result or input languages that can produce '<': a forced value could spell </result> or a
    # chat template's special tokens (a role injection)
    _refuse("lt_regex", "lt_in_regex", _echo_with_manifest(result_regex="[^#]*")),
    _refuse(
        "lt_regex_escape", "lt_in_regex_escape", _echo_with_manifest(result_regex="[0-9]|\\x3c")
    ),
    _refuse("lt_grammar", "lt_in_grammar", _echo_with_manifest(input_grammar='root ::= [^"]+')),
    # nesting past the contract's bound (XGrammar refuses ~1,000 deep): the daemon once took a
    # grammar nested 1,500 deep that evald build refused, and every lowering of it then failed
    _refuse(
        "deep_grammar",
        "grammar_nested_1500_deep",
        _echo_with_manifest(input_grammar="root ::= " + "(" * 1_500 + '"a"' + ")" * 1_500),
    ),
    _refuse(
        "deep_regex",
        "regex_nested_past_the_bound",
        _echo_with_manifest(result_regex="(" * 257 + "a" + ")" * 257),
    ),
)


def refused_modules(prefix: str, *, memory_bytes: int, module_bytes: int) -> list[MaliciousModule]:
    """The modules of :data:`REFUSED_AT_REGISTRATION`, built for a run.

    ``prefix`` keeps names unique per run; ``memory_bytes`` is the attacker's memory limit and
    ``module_bytes`` the host's module cap (attacks one page or one byte over them).
    """
    params = AttackParams(prefix, memory_bytes=memory_bytes, module_bytes=module_bytes)
    return [row.module(params) for row in REFUSED_AT_REGISTRATION]
