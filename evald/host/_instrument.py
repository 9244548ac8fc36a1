"""Makes a refused ``memory.grow`` visible to the host, and a module's state resettable.

wasmtime enforces the memory cap (``Store.set_limits``) by making ``memory.grow`` return -1,
and the C API offers no callback to observe that. A guest that then traps (a Zig allocator
panics with ``unreachable``) would be reported as a plain fault although the cause is the
tenant's memory limit. So before compiling, the host rewrites every ``memory.grow`` into a call
to a small added function that performs the grow and sets an added global when it returns -1,
and adds a wrapper around ``evald_eval`` that clears the global first:

* ``__evald_eval(len) -> i32``: clears the flag, calls ``evald_eval``;
* ``__evald_grow_refused``: an exported mutable ``i32`` global, 1 after a refused grow;
* ``__evald_eval_fresh(len) -> i32``, only in a module whose whole state is its linear memory
  and its globals (:func:`reset_blocker` finds none of the rest): sets every mutable global
  back to its initial value (its own constant expression, copied), then does what
  ``__evald_eval`` does. With the linear memory put back to its image by the host
  (:class:`evald.host._memory_reset.MemoryReset`), a call through it starts from exactly the state
  a new instance would have: ``isolation = "fresh"`` then keeps the instance (docs/design.md
  §5, "Fresh instances").

The memory's size is guest state too, and wasmtime cannot shrink a memory. So the guest's size
is a second added global, the *guest size* in pages (initially the memory's minimum): every
``memory.size`` reads it, and the grow function grows it. A grow that fits in the pages the
memory already has (an earlier call of a fresh instance grew it) only moves the guest size; one
that does not grows the memory by what is missing, so the store's limits (cap, maximum, pool
slot) see exactly the total a new instance would ask for and refuse it in the same cases. The
fresh wrapper puts the guest size back like any global: after a call that grew the memory, the
next one sees a new instance's ``memory.size`` and ``memory.grow`` results, while the host
zeroes the pages above the image like any page a call wrote. Outside the fresh wrapper the
guest size always equals the memory's size. What differs from a new instance: a load or store
between the guest size and the memory's real size (past ``memory.size``) reads zeros or
writes instead of trapping; no byte of an earlier call is there to read.

What else an instance could carry from one call to the next, and why the fresh wrapper is
withheld then: a start function (globals would start from what it computed, not from their
initial values); ``table.set``, ``table.grow``, ``table.fill``, ``table.copy``, ``table.init``
(a changed table); ``data.drop`` and ``elem.drop`` (a dropped segment stays dropped). Nothing
else is mutable in the features the engine enables (no GC, exceptions, threads or multiple
memories).

Only the added exports are new; function, global and type indices of the original module are
unchanged (the additions go at the end of each index space), so name sections, element
segments and ``ref.func`` stay valid. The rewrite decodes every instruction of every body; a
body with an opcode outside the enabled feature set makes :func:`instrument_memory_grow` return
None, and the host then runs the module unmodified (a refused grow is then reported by its
trap code, like any fault).
"""

from __future__ import annotations

from evald.contract import encode_uleb128
from evald.host._wasm_binary import SECTION_ORDER, ModuleInfo, Reader, WasmFormatError
from evald.host._wasm_code import MEMORY_GROW, MEMORY_SIZE, read_instruction

__all__ = [
    "EVAL_WRAPPER_EXPORT",
    "FRESH_WRAPPER_EXPORT",
    "GROW_FLAG_EXPORT",
    "INSTRUMENTATION_VERSION",
    "RESERVED_EXPORT_PREFIX",
    "instrument_memory_grow",
    "reset_blocker",
]

INSTRUMENTATION_VERSION = 3
RESERVED_EXPORT_PREFIX = "__evald_"
EVAL_WRAPPER_EXPORT = "__evald_eval"
FRESH_WRAPPER_EXPORT = "__evald_eval_fresh"
GROW_FLAG_EXPORT = "__evald_grow_refused"

_I32 = 0x7F
_END = 0x0B
_GLOBAL_GET = 0x23
_GLOBAL_SET = 0x24
#: Instructions that change a table: table.set (0x26) and these 0xFC sub-opcodes.
_TABLE_SET = 0x26
#: 0xFC sub-opcodes that leave state behind: data.drop, table.init, elem.drop, table.copy,
#: table.grow, table.fill (memory.init reads a segment; without data.drop it stays intact).
_STATEFUL_FC = {
    9: "data.drop",
    12: "table.init",
    13: "elem.drop",
    14: "table.copy",
    15: "table.grow",
    17: "table.fill",
}


def _mutable_globals(wasm: bytes, info: ModuleInfo) -> list[tuple[int, bytes]]:
    """(index, initial-value expression without its ``end``) of each mutable global."""
    section = info.section(6)
    if section is None:
        return []
    reader = Reader(wasm, section.content_start, section.end)
    found = []
    for index in range(reader.uleb()):
        code = reader.byte()
        if code in (0x64, 0x63):  # (ref ht) / (ref null ht)
            reader.sleb(33)
        mutable = reader.byte() == 1
        start = reader.pos
        while True:
            at = reader.pos
            if read_instruction(reader) == _END:
                break
        if mutable:
            found.append((index, wasm[start:at]))
    return found


def reset_blocker(wasm: bytes, info: ModuleInfo) -> str:
    """Why an instance of ``wasm`` cannot be put back to its initial state by resetting its
    globals and memory (see the module docstring), or ``""`` when it can.

    Raises:
        WasmFormatError: a body this reader cannot decode.
    """
    if info.start_function is not None:
        return "it has a start function"
    section = info.section(10)
    if section is None:
        return ""
    reader = Reader(wasm, section.content_start, section.end)
    for _ in range(reader.uleb()):
        size = reader.uleb()
        body_end = reader.pos + size
        body = Reader(wasm, reader.pos, body_end)
        for _ in range(body.uleb()):
            body.uleb()
            body.byte()
        while not body.at_end():
            at = body.pos
            op = read_instruction(body)
            if op == _TABLE_SET:
                return "it uses table.set"
            if op == 0xFC:
                sub = Reader(wasm, at + 1, body_end).uleb()
                if sub in _STATEFUL_FC:
                    return f"it uses {_STATEFUL_FC[sub]}"
        reader.pos = body_end
    return ""


def _rewrite_body(code: bytes, start: int, end: int, hook: bytes, size: bytes) -> tuple[bytes, int]:
    """Returns the body's expression with each ``memory.grow`` replaced by ``hook`` (a call of
    the grow function) and each ``memory.size`` by ``size`` (a read of the guest size)."""
    reader = Reader(code, start, end)
    out = bytearray()
    copied_from = start
    grows = 0
    while not reader.at_end():
        at = reader.pos
        op = read_instruction(reader)
        if op == MEMORY_GROW or op == MEMORY_SIZE:
            out += code[copied_from:at]
            out += hook if op == MEMORY_GROW else size
            copied_from = reader.pos
            grows += op == MEMORY_GROW
    out += code[copied_from:end]
    return bytes(out), grows


def _vector(items: list[bytes]) -> bytes:
    return encode_uleb128(len(items)) + b"".join(items)


def _section(section_id: int, content: bytes) -> bytes:
    return bytes([section_id]) + encode_uleb128(len(content)) + content


def _append_to_vector(wasm: bytes, content_start: int, end: int, extra: list[bytes]) -> bytes:
    reader = Reader(wasm, content_start, end)
    count = reader.uleb()
    return encode_uleb128(count + len(extra)) + wasm[reader.pos : end] + b"".join(extra)


def instrument_memory_grow(wasm: bytes, info: ModuleInfo, eval_function: int) -> bytes | None:
    """Returns the rewritten module, or None when a body uses an opcode this rewrite cannot read.

    ``info`` must come from :func:`evald.host._wasm_binary.parse_module` of ``wasm``, and the module
    must have passed the ABI checks (no imports, so defined indices start at 0; one memory).
    ``eval_function`` is the function index exported as ``evald_eval``. The fresh wrapper is
    added only when :func:`reset_blocker` finds nothing.
    """
    if len(info.memories) != 1:
        return None
    try:
        resettable = not reset_blocker(wasm, info)
        mutable = _mutable_globals(wasm, info) if resettable else []
    except WasmFormatError:
        return None
    type_index = len(info.types)
    hook_index = len(info.function_types)  # then the wrapper, then the fresh wrapper
    flag = encode_uleb128(info.global_count)
    guest_size = encode_uleb128(info.global_count + 1)
    initial_pages = bytes([0x41]) + _sleb128(info.memories[0].minimum_pages)
    bodies = _added_bodies(flag, guest_size, initial_pages, eval_function, hook_index + 1, mutable)
    if not resettable:
        bodies = bodies[:2]
    additions = {
        1: [bytes([0x60, 1, _I32, 1, _I32])],
        3: [encode_uleb128(type_index)] * len(bodies),
        6: [bytes([_I32, 0x01, 0x41, 0x00, 0x0B]), bytes([_I32, 0x01]) + initial_pages + b"\x0b"],
        7: _added_exports(flag, hook_index + 1, hook_index + 2, resettable),
    }
    hook_call = b"\x10" + encode_uleb128(hook_index)
    size_read = bytes([_GLOBAL_GET]) + guest_size
    try:
        return _assemble(wasm, info, additions, hook_call, size_read, bodies)
    except WasmFormatError:
        return None


def _sleb128(value: int) -> bytes:
    """``value`` as a signed LEB128 immediate (of ``i32.const``)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if (value == 0 and not byte & 0x40) or (value == -1 and byte & 0x40):
            return bytes(out + bytes([byte]))
        out.append(byte | 0x80)


def _grow_body(flag: bytes, guest_size: bytes) -> bytes:
    """The grow function ``(param $pages i32) (result i32) (local $old i32)``: what
    ``memory.grow`` of a new instance at the guest size returns, growing the memory only by the
    pages it lacks (see the module docstring)."""
    old, pages, real_size = b"\x20\x01", b"\x20\x00", b"\x3f\x00"
    move_guest_size = old + pages + b"\x6a\x24" + guest_size  # global.set (old + pages)
    return b"".join(
        [
            b"\x01\x01\x7f",  # the local $old
            b"\x23" + guest_size + b"\x21\x01",  # $old = the guest size
            # if $pages <= memory.size - $old (unsigned): the memory has them already
            pages + real_size + old + b"\x6b\x4d\x04\x40",
            move_guest_size + old + b"\x0f\x0b",  # move the guest size; return $old; end
            # memory.grow ($pages - (memory.size - $old)): the pages it lacks
            pages + real_size + old + b"\x6b\x6b\x40\x00",
            # refused (-1): set the flag, return -1, like the grow of a new instance
            b"\x41\x7f\x46\x04\x40\x41\x01\x24" + flag + b"\x41\x7f\x0f\x0b",
            move_guest_size + old + b"\x0b",  # move the guest size; $old
        ]
    )


def _added_bodies(
    flag: bytes,
    guest_size: bytes,
    initial_pages: bytes,
    eval_function: int,
    wrapper_index: int,
    mutable: list[tuple[int, bytes]],
) -> list[bytes]:
    """The added functions' bodies, each with its size: the grow function, the wrapper, and the
    fresh wrapper (which a module that is not resettable does not get)."""
    wrapper_body = (
        b"\x00\x41\x00\x24"
        + flag  # i32.const 0; global.set flag
        + b"\x20\x00\x10"
        + encode_uleb128(eval_function)
        + b"\x0b"
    )
    # the fresh wrapper: every mutable global (the guest size too) to its initial value, then
    # the plain wrapper
    fresh_body = (
        b"\x00"
        + b"".join(expr + bytes([_GLOBAL_SET]) + encode_uleb128(i) for i, expr in mutable)
        + initial_pages
        + bytes([_GLOBAL_SET])
        + guest_size
        + b"\x20\x00\x10"
        + encode_uleb128(wrapper_index)
        + b"\x0b"
    )
    bodies = [_grow_body(flag, guest_size), wrapper_body, fresh_body]
    return [encode_uleb128(len(body)) + body for body in bodies]


def _added_exports(
    flag: bytes, wrapper_index: int, fresh_index: int, resettable: bool
) -> list[bytes]:
    """The added exports: the wrapper, the grow flag, and (resettable) the fresh wrapper."""
    exports = [
        encode_uleb128(len(EVAL_WRAPPER_EXPORT))
        + EVAL_WRAPPER_EXPORT.encode()
        + b"\x00"
        + encode_uleb128(wrapper_index),
        encode_uleb128(len(GROW_FLAG_EXPORT)) + GROW_FLAG_EXPORT.encode() + b"\x03" + flag,
    ]
    if resettable:
        exports.append(
            encode_uleb128(len(FRESH_WRAPPER_EXPORT))
            + FRESH_WRAPPER_EXPORT.encode()
            + b"\x00"
            + encode_uleb128(fresh_index)
        )
    return exports


def _assemble(
    wasm: bytes,
    info: ModuleInfo,
    additions: dict[int, list[bytes]],
    hook_call: bytes,
    size_read: bytes,
    added_bodies: list[bytes],
) -> bytes | None:
    """The module with ``additions`` appended to their sections (a section the module lacks is
    created in its place in the order) and every body rewritten, ``added_bodies`` last.

    Raises:
        WasmFormatError: a body this reader cannot decode.
    """
    out = bytearray(wasm[:8])
    pending = dict(additions)
    code_section = None
    for section in info.sections:
        rank = SECTION_ORDER.get(section.id)
        if rank is not None:
            # sections we add that the module lacks go before the first later section
            for missing in sorted(pending, key=SECTION_ORDER.__getitem__):
                if SECTION_ORDER[missing] < rank and info.section(missing) is None:
                    out += _section(missing, _vector(pending.pop(missing)))
        if section.id in pending:
            content = _append_to_vector(
                wasm, section.content_start, section.end, pending.pop(section.id)
            )
            out += _section(section.id, content)
        elif section.id == 10:
            code_section = section
            bodies = _rewrite_bodies(wasm, section.content_start, section.end, hook_call, size_read)
            out += _section(10, _vector(bodies + added_bodies))
        else:
            out += wasm[section.start : section.end]
    if code_section is None or pending:
        return None  # a module without code exports no functions; the validator refuses it
    return bytes(out)


def _rewrite_bodies(
    wasm: bytes, start: int, end: int, hook_call: bytes, size_read: bytes
) -> list[bytes]:
    """Every body of the code section at ``start:end``, each ``memory.grow`` a call of the hook
    and each ``memory.size`` a read of the guest size, each with its new size."""
    reader = Reader(wasm, start, end)
    bodies = []
    for _ in range(reader.uleb()):
        size = reader.uleb()
        body_start = reader.pos
        body_end = body_start + size
        body = Reader(wasm, body_start, body_end)
        for _ in range(body.uleb()):
            body.uleb()
            body.byte()
        expr, _ = _rewrite_body(wasm, body.pos, body_end, hook_call, size_read)
        new_body = wasm[body_start : body.pos] + expr
        bodies.append(encode_uleb128(len(new_body)) + new_body)
        reader.pos = body_end
    return bodies
