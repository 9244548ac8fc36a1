"""ABI v1 modules written in WAT, with a chosen behaviour: an echo, a loop, a fuel burner, a
memory grower, a deep recursion, a bad output pointer, and so on.

An evaluator that misbehaves on demand is what a test of anything around the daemon needs (an
engine integration that must survive a stalled or failing span, the host's limit pairs, the
fuzzer's malicious modules), so it lives in the product beside :func:`evald.testing.start_daemon`
and needs no Zig and no guest sources.

:func:`guest` builds a module from a behaviour of ``evald_eval``; most behaviours read their
size parameter N from the first four input bytes (little-endian, see :func:`arg`), so one module
serves a whole n / n+1 pair. Everything the validator checks can be broken on purpose through
keyword arguments (missing or mistyped exports, imports, a start function, memory size,
manifest). wasmtime compiles the text (``wasmtime.wat2wasm``); the manifest is appended as the
``evald.manifest`` custom section exactly as the real toolchain does.

Buffer layout: input at ``IN_PTR`` (``in_cap`` bytes), output right after it (``out_cap``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any, Final

import wasmtime

from evald.contract import ABI_VERSION, MANIFEST_SECTION, append_custom_section

__all__ = [
    "IN_PTR",
    "MANIFEST",
    "PAGE",
    "REMEMBERED_NOTHING",
    "REMEMBER_HEAP",
    "arg",
    "branchy_function",
    "guest",
    "manifest_bytes",
    "named_guest",
    "remembered",
    "wat_text",
]

IN_PTR = 1024
PAGE = 65536
#: Where ``remember`` keeps the previous input (its second page: the guest's "heap").
REMEMBER_HEAP = PAGE
#: What ``remember`` answers when nothing survived from an earlier call.
REMEMBERED_NOTHING = "G\0\0\0\0H"


def remembered(previous: bytes) -> str:
    """What ``remember`` answers after a call with input ``previous`` on the same instance."""
    return "G" + (previous[:4] + bytes(4))[:4].decode() + "H" + previous.decode()


MANIFEST: dict[str, Any] = {
    "abi": ABI_VERSION,
    "name": "probe",
    "version": "1.0.0",
    "tag": "probe",
    "semantics_version": "probe/1",
    "description": "A host test module.",
    "input_grammar": "root ::= [a-z0-9 ]*",
    "result_regex": "[a-z0-9 ]*",
}


def arg(n: int) -> bytes:
    """The input that passes N to a parameterised behaviour."""
    return struct.pack("<i", n)


def _n() -> str:
    return f"(i32.load (i32.const {IN_PTR}))"


def _wat_bytes(data: bytes) -> str:
    return "".join(f"\\{b:02x}" for b in data)


#: ``(locals, body, extra module fields)`` of ``evald_eval`` for one behaviour.
_Fragments = tuple[str, str, str]


def _ok(out_ptr: int) -> str:
    """Writes "ok" to the output buffer and returns its length."""
    return f"(i32.store16 (i32.const {out_ptr}) (i32.const 0x6b6f)) (i32.const 2)"


def _echo(out_ptr: int, param: Any) -> _Fragments:
    """The input, as is."""
    return (
        "",
        (f"(memory.copy (i32.const {out_ptr}) (i32.const {IN_PTR}) (local.get 0)) (local.get 0)"),
        "",
    )


def _loop(out_ptr: int, param: Any) -> _Fragments:
    """Never returns (only the deadline or fuel stops it)."""
    return "", "(loop $forever (br $forever)) (i32.const 0)", ""


def _burn(out_ptr: int, param: Any) -> _Fragments:
    """N loop iterations, then "ok"."""
    return (
        "(local $i i32)",
        (
            "(block $done (loop $next "
            f"(br_if $done (i32.ge_u (local.get $i) {_n()})) "
            "(local.set $i (i32.add (local.get $i) (i32.const 1))) (br $next))) " + _ok(out_ptr)
        ),
        "",
    )


def _grow(out_ptr: int, param: Any) -> _Fragments:
    """Grow by N pages, trap when refused (an allocator that panics)."""
    return (
        "",
        (f"(if (i32.eq (memory.grow {_n()}) (i32.const -1)) (then (unreachable))) " + _ok(out_ptr)),
        "",
    )


def _grow_soft(out_ptr: int, param: Any) -> _Fragments:
    """Grow by N pages, a guest error when refused."""
    payload = b"too_large:out of memory"
    return (
        "",
        (
            f"(if (i32.eq (memory.grow {_n()}) (i32.const -1)) (then "
            f"(return (i32.const -{len(payload)})))) " + _ok(out_ptr)
        ),
        (f'(data (i32.const {out_ptr}) "{_wat_bytes(payload)}")'),
    )


def _fill(out_ptr: int, param: Any) -> _Fragments:
    """Memory of N pages in all, each new byte written (resident), "ok"."""
    return (
        "(local $have i32)",
        (
            "(local.set $have (memory.size)) "
            f"(if (i32.lt_u (local.get $have) {_n()}) (then "
            f"(if (i32.eq (memory.grow (i32.sub {_n()} (local.get $have))) (i32.const -1)) "
            "(then (unreachable))) "
            "(memory.fill (i32.mul (local.get $have) (i32.const 65536)) (i32.const 1) "
            f"(i32.mul (i32.sub {_n()} (local.get $have)) (i32.const 65536))))) " + _ok(out_ptr)
        ),
        "",
    )


def _grow_pages(out_ptr: int, param: Any) -> _Fragments:
    """Grow by 1 page N times, trap on the first refusal."""
    return (
        "(local $i i32)",
        (
            "(block $done (loop $next "
            f"(br_if $done (i32.ge_u (local.get $i) {_n()})) "
            "(if (i32.eq (memory.grow (i32.const 1)) (i32.const -1)) (then (unreachable))) "
            "(local.set $i (i32.add (local.get $i) (i32.const 1))) (br $next))) " + _ok(out_ptr)
        ),
        "",
    )


def _recurse(out_ptr: int, param: Any) -> _Fragments:
    """Recursion N deep, then "ok"."""
    return (
        "",
        f"(drop (call $down {_n()})) " + _ok(out_ptr),
        (
            "(func $down (param i32) (result i32) "
            "(if (result i32) (i32.eqz (local.get 0)) (then (i32.const 0)) "
            "(else (i32.add (call $down (i32.sub (local.get 0) (i32.const 1))) "
            "(i32.const 1)))))"
        ),
    )


def _output(out_ptr: int, param: Any) -> _Fragments:
    """A value of N bytes "x"."""
    return "", (f"(memory.fill (i32.const {out_ptr}) (i32.const 0x78) {_n()}) {_n()}"), ""


def _payload(out_ptr: int, param: Any) -> _Fragments:
    """Returns the given bytes; negative length when error=True."""
    data, is_error = param
    length = -len(data) if is_error else len(data)
    return "", f"(i32.const {length})", f'(data (i32.const {out_ptr}) "{_wat_bytes(data)}")'


def _return(out_ptr: int, param: Any) -> _Fragments:
    """Returns a fixed number."""
    return "", f"(i32.const {param})", ""


def _dump_input(out_ptr: int, param: Any) -> _Fragments:
    """Returns the first K bytes of the input buffer, whatever len is."""
    return (
        "",
        (
            f"(memory.copy (i32.const {out_ptr}) (i32.const {IN_PTR}) "
            f"(i32.const {param})) (i32.const {param})"
        ),
        "",
    )


def _count(out_ptr: int, param: Any) -> _Fragments:
    """Calls on this instance so far, as one digit; an empty input traps."""
    return (
        "",
        (
            "(if (i32.eqz (local.get 0)) (then (unreachable))) "
            "(global.set $count (i32.add (global.get $count) (i32.const 1))) "
            f"(i32.store8 (i32.const {out_ptr}) (i32.add (i32.const 48) "
            "(i32.rem_u (global.get $count) (i32.const 10)))) (i32.const 1)"
        ),
        ("(global $count (mut i32) (i32.const 0))"),
    )


def _stale_output(out_ptr: int, param: Any) -> _Fragments:
    """Writes len bytes "x"; an empty input returns param bytes as is."""
    return (
        "",
        (
            f"(if (i32.eqz (local.get 0)) (then (return (i32.const {param})))) "
            f"(memory.fill (i32.const {out_ptr}) (i32.const 0x78) (local.get 0)) (local.get 0)"
        ),
        "",
    )


def _grow_or_trap(out_ptr: int, param: Any) -> _Fragments:
    """Input "g": a refused huge grow, then "ok"; otherwise a trap."""
    return (
        "",
        (
            f"(if (i32.eq (i32.load8_u (i32.const {IN_PTR})) (i32.const 0x67)) (then "
            "(drop (memory.grow (i32.const 60000))) "
            f"(i32.store16 (i32.const {out_ptr}) (i32.const 0x6b6f)) (return (i32.const 2)))) "
            "(unreachable)"
        ),
        "",
    )


def _dump_or_error(out_ptr: int, param: Any) -> _Fragments:
    """Input starting with "e": a syntax error; else dump_input."""
    spare = out_ptr + 2048
    return (
        "",
        (
            f"(if (i32.eq (i32.load8_u (i32.const {IN_PTR})) (i32.const 0x65)) (then "
            f"(memory.copy (i32.const {out_ptr}) (i32.const {spare}) (i32.const 6)) "
            "(return (i32.const -6)))) "
            f"(memory.copy (i32.const {out_ptr}) (i32.const {IN_PTR}) (i32.const {param})) "
            f"(i32.const {param})"
        ),
        f'(data (i32.const {spare}) "syntax")',
    )


def _table_grow(out_ptr: int, param: Any) -> _Fragments:
    """Grow a table by N elements: "ok" when granted, "no" when refused."""
    no = f"(i32.store16 (i32.const {out_ptr}) (i32.const 0x6f6e)) (i32.const 2)"
    return (
        "",
        (
            f"(if (i32.eq (table.grow $t (ref.null func) {_n()}) (i32.const -1)) "
            f"(then (return {no}))) " + _ok(out_ptr)
        ),
        "(table $t 1 funcref)",
    )


def _table_fill(out_ptr: int, param: Any) -> _Fragments:
    """A table of param elements, filled on every call."""
    return (
        "",
        f"(table.fill $t (i32.const 0) (ref.func $eval) (i32.const {param})) " + _ok(out_ptr),
        f"(table $t {param} funcref) (elem declare func $eval)",
    )


def _memory_probe(out_ptr: int, param: Any) -> _Fragments:
    """Grow one page at a time until refused; the page count, decimal."""
    return (
        "(local $pages i32) (local $digits i32) (local $at i32)",
        (
            "(block $full (loop $grow "
            "(br_if $full (i32.eq (memory.grow (i32.const 1)) (i32.const -1))) (br $grow))) "
            f"(local.set $pages (memory.size)) (local.set $at (i32.const {out_ptr + 16})) "
            "(loop $digit "
            "(local.set $at (i32.sub (local.get $at) (i32.const 1))) "
            "(i32.store8 (local.get $at) (i32.add (i32.const 48) "
            "(i32.rem_u (local.get $pages) (i32.const 10)))) "
            "(local.set $pages (i32.div_u (local.get $pages) (i32.const 10))) "
            "(local.set $digits (i32.add (local.get $digits) (i32.const 1))) "
            "(br_if $digit (local.get $pages))) "
            f"(memory.copy (i32.const {out_ptr}) (local.get $at) (local.get $digits)) "
            "(local.get $digits)"
        ),
        "",
    )


def _remember(out_ptr: int, param: Any) -> _Fragments:
    """What the previous call left in a global and the heap, then keeps this one's."""
    heap = REMEMBER_HEAP
    return (
        "(local $n i32)",
        (
            f"(i32.store8 (i32.const {out_ptr}) (i32.const 0x47)) "  # G
            f"(i32.store (i32.const {out_ptr + 1}) (global.get $seen)) "
            f"(i32.store8 (i32.const {out_ptr + 5}) (i32.const 0x48)) "  # H
            f"(local.set $n (i32.load (i32.const {heap}))) "
            f"(memory.copy (i32.const {out_ptr + 6}) (i32.const {heap + 4}) (local.get $n)) "
            f"(global.set $seen (i32.load (i32.const {IN_PTR}))) "
            f"(i32.store (i32.const {heap}) (local.get 0)) "
            f"(memory.copy (i32.const {heap + 4}) (i32.const {IN_PTR}) (local.get 0)) "
            # an input starting with "!" traps once it is kept
            f"(if (i32.eq (i32.load8_u (i32.const {IN_PTR})) (i32.const 0x21)) "
            "(then (unreachable))) "
            "(i32.add (i32.const 6) (local.get $n))"
        ),
        "(global $seen (mut i32) (i32.const 0))",
    )


def _trap(out_ptr: int, param: Any) -> _Fragments:
    """Traps (``unreachable``)."""
    return "", "(unreachable)", ""


def _oob(out_ptr: int, param: Any) -> _Fragments:
    """Loads out of bounds (a trap)."""
    return "", "(i32.load (i32.const -16))", ""


_BEHAVIOURS: Final[dict[str, Callable[[int, Any], _Fragments]]] = {
    "echo": _echo,
    "loop": _loop,
    "burn": _burn,
    "grow": _grow,
    "grow_soft": _grow_soft,
    "fill": _fill,
    "grow_pages": _grow_pages,
    "recurse": _recurse,
    "output": _output,
    "payload": _payload,
    "return": _return,
    "dump_input": _dump_input,
    "count": _count,
    "stale_output": _stale_output,
    "grow_or_trap": _grow_or_trap,
    "dump_or_error": _dump_or_error,
    "table_grow": _table_grow,
    "table_fill": _table_fill,
    "memory_probe": _memory_probe,
    "remember": _remember,
    "trap": _trap,
    "oob": _oob,
}


def _behaviour(kind: str, out_ptr: int, param: Any) -> _Fragments:
    """(locals, body, extra module fields) of ``evald_eval`` for one behaviour."""
    build = _BEHAVIOURS.get(kind)
    if build is None:
        raise ValueError(f"unknown behaviour {kind}")
    return build(out_ptr, param)


def wat_text(
    kind: str = "echo",
    param: Any = None,
    *,
    pages: int = 1,
    max_pages: int | None = None,
    in_cap: int = 4096,
    out_cap: int = 4096,
    abi_version: int = 1,
    omit: tuple[str, ...] = (),
    retype: dict[str, str] | None = None,
    imports: str = "",
    start: str | None = None,
    in_ptr: int = IN_PTR,
    extra: str = "",
) -> str:
    """The WAT text of a test module (see :func:`guest`)."""
    out_ptr = in_ptr + in_cap
    pages = max(pages, -(-(IN_PTR + in_cap + out_cap) // PAGE), 2 if kind == "remember" else 1)
    locals_, body, fields = _behaviour(kind, out_ptr, param)
    getters = {
        "evald_abi_version": abi_version,
        "evald_input_ptr": in_ptr,
        "evald_input_cap": in_cap,
        "evald_output_ptr": out_ptr,
        "evald_output_cap": out_cap,
    }
    retype = retype or {}
    lines = ["(module", imports]
    if "memory" not in omit:
        limits = f"{pages} {max_pages}" if max_pages is not None else f"{pages}"
        lines.append(f'(memory $mem (export "memory") {limits})')
    for name, value in getters.items():
        if name in omit:
            continue
        signature = retype.get(name, "(result i32)")
        result = f"(i32.const {value})" if signature == "(result i32)" else "(unreachable)"
        lines.append(f'(func (export "{name}") {signature} {result})')
    if "evald_eval" not in omit:
        signature = retype.get("evald_eval", "(param i32) (result i32)")
        if signature == "(param i32) (result i32)":
            lines.append(f'(func $eval (export "evald_eval") {signature} {locals_} {body})')
        else:
            lines.append(f'(func $eval (export "evald_eval") {signature} (unreachable))')
    lines.append(fields)
    if start is not None:
        lines.append(f"(func $start {start}) (start $start)")
    lines.append(extra)
    lines.append(")")
    return "\n".join(lines)


def manifest_bytes(**changes: Any) -> bytes:
    """The default manifest JSON with ``changes`` applied (a value of ... removes the field)."""
    manifest = dict(MANIFEST)
    for key, value in changes.items():
        if value is ...:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    return json.dumps(manifest).encode()


def guest(
    kind: str = "echo",
    param: Any = None,
    *,
    manifest: bytes | None = None,
    manifests: int = 1,
    **options: Any,
) -> bytes:
    """An ABI v1 module whose ``evald_eval`` has behaviour ``kind``.

    Behaviours: ``echo``; ``loop`` (forever); ``burn`` (N iterations); ``grow`` (N pages, trap
    when refused); ``fill`` (memory of N pages in all, every new byte written, so they are
    resident; trap when refused); ``grow_soft`` (N pages, ``too_large`` when refused);
    ``grow_pages`` (1 page N times, trap on refusal); ``recurse`` (N deep); ``output`` (N
    bytes); ``payload`` (``param=(bytes, is_error)``); ``return`` (``param`` as the result);
    ``dump_input`` (``param`` bytes of the input buffer); ``count`` (calls so far on this
    instance, one digit; an empty input traps); ``stale_output`` (an empty input returns
    ``param`` bytes of whatever the output buffer holds); ``grow_or_trap``; ``dump_or_error``
    (an input starting with "e" is a ``syntax`` error, any other input returns ``param`` bytes
    of the input buffer); ``table_grow`` (grow a table by N: "ok", or "no" when refused);
    ``table_fill`` (fill a table of ``param`` elements); ``memory_probe`` (grow until refused,
    return the page count in decimal); ``remember`` (answers what an earlier call left in a
    global and in its heap, the second page — :data:`REMEMBERED_NOTHING` when nothing,
    :func:`remembered` of the previous input when it shares the instance —, then keeps this
    input there, and traps when it starts with "!"); ``trap``; ``oob``. N comes from :func:`arg`.

    ``manifests`` is how many manifest sections to append (0 for none); other keyword
    arguments go to :func:`wat_text`.
    """
    wasm = bytes(wasmtime.wat2wasm(wat_text(kind, param, **options)))
    payload = manifest if manifest is not None else manifest_bytes()
    for _ in range(manifests):
        wasm = append_custom_section(wasm, MANIFEST_SECTION, payload)
    return wasm


def branchy_function(locals_count: int, branches: int) -> str:
    """A WAT function of ``branches`` ``if`` blocks over ``locals_count`` i32 locals (one of
    them its parameter), each copying one local to another: the shape whose compile cost grows
    with locals times branches (``evald.host._compile_cost``). For ``guest(extra=...)``."""
    locals_decl = "(local" + " i32" * (locals_count - 1) + ")" if locals_count > 1 else ""
    body = []
    for i in range(branches):
        a, b, c = i % locals_count, (i * 7 + 1) % locals_count, (i * 13 + 3) % locals_count
        body.append(f"(if (local.get {a}) (then (local.set {c} (local.get {b}))))")
    return f"(func (param i32) (result i32) {locals_decl} {' '.join(body)} (local.get 0))"


def named_guest(kind: str, name: str, param: Any = None, **options: Any) -> bytes:
    """A :func:`guest` whose manifest name and tag are ``name`` (a module to register)."""
    return guest(
        kind,
        param,
        manifest=manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1"),
        **options,
    )
