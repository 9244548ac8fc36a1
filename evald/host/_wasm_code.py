"""Instructions of function bodies: one decoder for every pass that reads code.

The host reads code twice before compiling: the compile-cost check
(:mod:`evald.host._compile_cost`) counts each function's branches, and the memory rewrite
(:mod:`evald.host._instrument`) replaces ``memory.grow`` and ``memory.size``. Both walk the
body with :func:`read_instruction`, which knows the shape of every instruction's immediates for
the features the host's engine enables (MVP, sign-extension, multi-value, reference types, bulk
memory, saturating conversions, SIMD); anything else is a :class:`WasmFormatError`.
"""

from __future__ import annotations

from typing import Final

from evald.host._wasm_binary import Reader, WasmFormatError

__all__ = ["BRANCH_OPCODES", "MEMORY_GROW", "MEMORY_SIZE", "read_instruction"]

MEMORY_SIZE: Final = 0x3F
MEMORY_GROW: Final = 0x40
#: Instructions that begin, split or end a basic block: block, loop, if, else, br, br_if,
#: br_table. The compiler makes a block of each, and its cost grows with their number.
BRANCH_OPCODES: Final = frozenset([0x02, 0x03, 0x04, 0x05, 0x0C, 0x0D, 0x0E])

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


def read_instruction(reader: Reader) -> int:
    """Reads the instruction at ``reader.pos`` and returns its opcode, the reader left after
    its immediates.

    Raises:
        WasmFormatError: an opcode outside the enabled features, or truncated immediates.
    """
    op = reader.byte()
    if op in _NO_IMMEDIATE:
        return op
    if op in _ONE_U32:
        reader.uleb()
    elif op in _MEMARG:
        _memarg(reader)
    elif op in _BLOCK:
        kind = reader.data[reader.pos] if reader.pos < reader.end else -1
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
        raise WasmFormatError(f"opcode {op:#x} at offset {reader.pos - 1} is not supported")
    return op
