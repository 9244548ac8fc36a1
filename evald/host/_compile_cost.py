"""What compiling one function may cost: its branches, and its locals times its branches.

wasmtime compiles each function with Cranelift, which cannot be interrupted, and whose memory
grows with the function's shape rather than with the module's size: it makes a basic block of
every branch, and its SSA construction gives a block a parameter for each local that is live
across it. Measured with wasmtime-py 50, one function of ``if`` blocks each copying one local
to another, compiled on one thread (the memory is the smallest data limit, ``RLIMIT_DATA``,
under which the compilation passed; "peak" is its peak resident memory without a limit):

========  ==========  ===========  =================
locals    branches    code         memory
========  ==========  ===========  =================
1,000     1,000       12 KB        128 MiB
3         10,000      90 KB        192 MiB
100       10,000      100 KB       192 MiB
3         20,000      180 KB       384 MiB
100       20,000      180 KB       over 256 MiB
2,000     20,000      236 KB       1.3 GiB peak
3         300,000     2.7 MB       2.0 GiB peak
========  ==========  ===========  =================

The module-wide caps (:data:`~evald.host._abi.MAX_FUNCTIONS`, ``MAX_CODE_BYTES``) do not bound
this: 437 KB of code in one function of 20,000 branches over 2,000 locals took a compile
worker to 1.85 GiB. So every function is held to :data:`MAX_FUNCTION_BRANCHES` branches and
:data:`MAX_FUNCTION_LOCAL_BRANCHES` locals times branches before anything is compiled. The
standard evaluators' largest function has 478 branches, and their largest product is 10,353
(51 locals, 203 branches): the caps leave them 20 and 100 times the room. The compile worker
also runs under a memory limit (:mod:`evald.host._compiler`); these caps refuse the shapes
known to be expensive early, with a message that says which function and why.
"""

from __future__ import annotations

from typing import Final

from evald.contract import ErrorCode, EvaldError
from evald.host._wasm_binary import ModuleInfo, Reader, WasmFormatError
from evald.host._wasm_code import BRANCH_OPCODES, read_instruction

__all__ = ["MAX_FUNCTION_BRANCHES", "MAX_FUNCTION_LOCAL_BRANCHES", "check_compile_cost"]

MAX_FUNCTION_BRANCHES: Final = 10_000
MAX_FUNCTION_LOCAL_BRANCHES: Final = 1_000_000
#: Every branch instruction takes at least this many bytes (opcode and an immediate).
_MIN_BRANCH_BYTES: Final = 2


def _branches(wasm: bytes, start: int, end: int) -> int:
    """Branch instructions in the expression ``wasm[start:end]``; where an instruction cannot
    be read, the most the bytes could hold."""
    reader = Reader(wasm, start, end)
    branches = 0
    try:
        while not reader.at_end():
            if read_instruction(reader) in BRANCH_OPCODES:
                branches += 1
    except WasmFormatError:
        return (end - start) // _MIN_BRANCH_BYTES
    return branches


def check_compile_cost(wasm: bytes, info: ModuleInfo) -> None:
    """Refuses a module with a function whose shape costs the compiler too much memory.

    ``info`` is :func:`~evald.host._wasm_binary.parse_module` of ``wasm``, which passed
    wasmtime's validation (so the code section is well formed).

    Raises:
        EvaldError: ``INVALID_MODULE`` naming the function, its branches and its locals.
    """
    code = info.section(10)
    if code is None:
        return
    reader = Reader(wasm, code.content_start, code.end)
    for index in range(reader.uleb()):
        size = reader.uleb()
        body_end = reader.pos + size
        body = Reader(wasm, reader.pos, body_end)
        declared = 0
        for _ in range(body.uleb()):  # (count, value type) groups
            declared += body.uleb()
            body.byte()
        function_type = info.function_type(index)
        params = len(function_type.params) if function_type is not None else 0
        local_count = params + declared
        branches = _branches(wasm, body.pos, body_end)
        reader.pos = body_end
        if branches > MAX_FUNCTION_BRANCHES:
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"function {index} has {branches} branch instructions; at most "
                f"{MAX_FUNCTION_BRANCHES} per function are compiled (compiling a function "
                "costs memory per branch: split it into smaller functions)",
            )
        if local_count * branches > MAX_FUNCTION_LOCAL_BRANCHES:
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"function {index} has {local_count} locals and {branches} branch "
                f"instructions; locals times branches may be at most "
                f"{MAX_FUNCTION_LOCAL_BRANCHES:,} per function (compiling costs memory for "
                "every local live across a branch: use fewer locals or split the function)",
            )
