"""Makes a refused ``memory.grow`` visible to the host.

wasmtime enforces the memory cap (``Store.set_limits``) by making ``memory.grow`` return -1,
and the C API offers no callback to observe that. A guest that then traps (a Zig allocator
panics with ``unreachable``) would be reported as a plain fault although the cause is the
tenant's memory limit. So before compiling, the host rewrites every ``memory.grow`` into a call
to a small added function that performs the grow and sets an added global when it returns -1,
and adds a wrapper around ``evald_eval`` that clears the global first:

* ``__evald_eval(len) -> i32``: clears the flag, calls ``evald_eval``;
* ``__evald_grow_refused``: an exported mutable ``i32`` global, 1 after a refused grow.

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

__all__ = [
    "EVAL_WRAPPER_EXPORT",
    "GROW_FLAG_EXPORT",
    "INSTRUMENTATION_VERSION",
    "RESERVED_EXPORT_PREFIX",
    "instrument_memory_grow",
]

INSTRUMENTATION_VERSION = 1
RESERVED_EXPORT_PREFIX = "__evald_"
EVAL_WRAPPER_EXPORT = "__evald_eval"
GROW_FLAG_EXPORT = "__evald_grow_refused"

_I32 = 0x7F
_VALTYPES = frozenset({0x7F, 0x7E, 0x7D, 0x7C, 0x7B, 0x70, 0x6F})

# Opcodes by the shape of their immediates (MVP, sign-extension, multi-value, reference types,
# bulk memory, saturating conversions, SIMD: the features the host's engine enables).
_NO_IMMEDIATE = frozenset([0x00, 0x01, 0x05, 0x0B, 0x0F, 0x1A, 0x1B, 0xD1, *range(0x45, 0xC5)])
_ONE_U32 = frozenset(
    [0x0C, 0x0D, 0x10, 0x12, 0x14, 0x15, 0x20, 0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x3F, 0x40, 0xD2]
)
_TWO_U32 = frozenset([0x11, 0x13])
_MEMARG = frozenset(range(0x28, 0x3F))
_BLOCK = frozenset([0x02, 0x03, 0x04])

# 0xFC sub-opcodes -> number of u32 immediates.
_FC_IMMEDIATES = {
    **dict.fromkeys(range(8), 0),
    8: 2,
    9: 1,
    10: 2,
    11: 1,
    12: 2,
    13: 1,
    14: 2,
    15: 1,
    16: 1,
    17: 1,
}


def _memarg(reader: Reader) -> None:
    align = reader.uleb()
    if align & 0x40:  # multi-memory: an explicit memory index follows
        reader.uleb()
    reader.uleb(64)


def _simd(reader: Reader) -> None:
    sub = reader.uleb()
    if sub <= 11 or sub in (92, 93):
        _memarg(reader)
    elif sub in (12, 13):
        reader.skip(16)
    elif 21 <= sub <= 34:
        reader.skip(1)
    elif 84 <= sub <= 91:
        _memarg(reader)
        reader.skip(1)
    elif sub > 0xFF:
        raise WasmFormatError(f"SIMD opcode {sub:#x} is not supported")


def _rewrite_body(code: bytes, start: int, end: int, hook: bytes) -> tuple[bytes, int]:
    """Returns the body's expression with each ``memory.grow`` replaced by ``call hook``."""
    reader = Reader(code, start, end)
    out = bytearray()
    copied_from = start
    grows = 0
    while not reader.at_end():
        at = reader.pos
        op = reader.byte()
        if op in _NO_IMMEDIATE:
            continue
        if op == 0x40:  # memory.grow memidx
            reader.uleb()
            out += code[copied_from:at]
            out += hook
            copied_from = reader.pos
            grows += 1
        elif op in _ONE_U32:
            reader.uleb()
        elif op in _MEMARG:
            _memarg(reader)
        elif op in _BLOCK:
            kind = code[reader.pos] if reader.pos < end else -1
            if kind == 0x40 or kind in _VALTYPES:
                reader.skip(1)
            else:
                reader.sleb(33)
        elif op in _TWO_U32:
            reader.uleb()
            reader.uleb()
        elif op == 0x0E:  # br_table
            for _ in range(reader.uleb() + 1):
                reader.uleb()
        elif op == 0x1C:  # select t*
            for _ in range(reader.uleb()):
                if reader.byte() not in _VALTYPES:
                    raise WasmFormatError("typed select with an unsupported value type")
        elif op == 0x41:
            reader.sleb(32)
        elif op == 0x42:
            reader.sleb(64)
        elif op == 0x43:
            reader.skip(4)
        elif op == 0x44:
            reader.skip(8)
        elif op == 0xD0:  # ref.null heaptype
            if reader.byte() not in (0x70, 0x6F):
                raise WasmFormatError("ref.null with an unsupported heap type")
        elif op == 0xFC:
            sub = reader.uleb()
            if sub not in _FC_IMMEDIATES:
                raise WasmFormatError(f"opcode 0xfc {sub} is not supported")
            for _ in range(_FC_IMMEDIATES[sub]):
                reader.uleb()
        elif op == 0xFD:
            _simd(reader)
        else:
            raise WasmFormatError(f"opcode {op:#x} at offset {at} is not supported")
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
    must have passed the ABI checks (no imports, so defined indices start at 0).
    ``eval_function`` is the function index exported as ``evald_eval``.
    """
    type_index = len(info.types)
    hook_index = len(info.function_types)
    wrapper_index = hook_index + 1
    flag_index = info.global_count
    hook_call = b"\x10" + encode_uleb128(hook_index)
    flag = encode_uleb128(flag_index)

    hook_body = (
        b"\x01\x01\x7f"  # one i32 local (index 1)
        b"\x20\x00\x40\x00\x22\x01"  # local.get 0; memory.grow 0; local.tee 1
        b"\x41\x7f\x46\x04\x40"  # i32.const -1; i32.eq; if
        b"\x41\x01\x24" + flag + b"\x0b"  # i32.const 1; global.set flag; end
        b"\x20\x01\x0b"
    )  # local.get 1; end
    wrapper_body = (
        b"\x00\x41\x00\x24"
        + flag  # i32.const 0; global.set flag
        + b"\x20\x00\x10"
        + encode_uleb128(eval_function)
        + b"\x0b"
    )
    additions = {
        1: [bytes([0x60, 1, _I32, 1, _I32])],
        3: [encode_uleb128(type_index), encode_uleb128(type_index)],
        6: [bytes([_I32, 0x01, 0x41, 0x00, 0x0B])],
        7: [
            encode_uleb128(len(EVAL_WRAPPER_EXPORT))
            + EVAL_WRAPPER_EXPORT.encode()
            + b"\x00"
            + encode_uleb128(wrapper_index),
            encode_uleb128(len(GROW_FLAG_EXPORT)) + GROW_FLAG_EXPORT.encode() + b"\x03" + flag,
        ],
    }

    out = bytearray(wasm[:8])
    pending = dict(additions)
    try:
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
                reader = Reader(wasm, section.content_start, section.end)
                bodies = []
                for _ in range(reader.uleb()):
                    size = reader.uleb()
                    body_start = reader.pos
                    body_end = body_start + size
                    body = Reader(wasm, body_start, body_end)
                    for _ in range(body.uleb()):
                        body.uleb()
                        body.byte()
                    expr, _ = _rewrite_body(wasm, body.pos, body_end, hook_call)
                    new_body = wasm[body_start : body.pos] + expr
                    bodies.append(encode_uleb128(len(new_body)) + new_body)
                    reader.pos = body_end
                bodies += [
                    encode_uleb128(len(hook_body)) + hook_body,
                    encode_uleb128(len(wrapper_body)) + wrapper_body,
                ]
                out += _section(10, _vector(bodies))
            else:
                out += wasm[section.start : section.end]
    except WasmFormatError:
        return None
    if code_section is None or pending:
        return None  # a module without code exports no functions; the validator refuses it
    return bytes(out)
