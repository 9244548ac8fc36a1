"""The evaluator ABI v1's names and numbers (docs/abi.md), and the one writer of its custom section.

A guest and the host agree on these: the ABI version a module reports, the exports the host
calls, and the custom section a module carries its manifest in. The host's checks
(``evald.host``), the SDK's build (``evald build``) and anything that writes a module by hand
(the WAT modules of :mod:`evald.testing`, the fuzzer's malicious ones) take them from here, so
a module that one side writes is a module the other side reads.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ABI_VERSION",
    "BUFFER_EXPORTS",
    "EVAL_EXPORT",
    "MANIFEST_SECTION",
    "VERSION_EXPORT",
    "append_custom_section",
    "encode_uleb128",
]

#: What ``evald_abi_version()`` returns and a manifest's ``abi`` field holds.
ABI_VERSION: Final = 1
#: The custom section that holds the manifest (JSON), exactly one per module.
MANIFEST_SECTION: Final = "evald.manifest"
VERSION_EXPORT: Final = "evald_abi_version"
EVAL_EXPORT: Final = "evald_eval"
#: The buffer getters, in the order the host reads them.
BUFFER_EXPORTS: Final = (
    "evald_input_ptr",
    "evald_input_cap",
    "evald_output_ptr",
    "evald_output_cap",
)

_WASM_MAGIC = b"\0asm"


def encode_uleb128(value: int) -> bytes:
    """``value`` as unsigned LEB128, the WebAssembly binary format's integer encoding.

    Raises:
        ValueError: ``value`` is negative.
    """
    if value < 0:
        raise ValueError(f"unsigned LEB128 cannot encode {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def append_custom_section(wasm: bytes, name: str, payload: bytes) -> bytes:
    """``wasm`` with a custom section ``name`` holding ``payload`` appended at its end (custom
    sections may follow any section; the build appends the manifest last).

    Raises:
        ValueError: ``wasm`` does not start with the WebAssembly magic.
    """
    if wasm[:4] != _WASM_MAGIC:
        raise ValueError("not a WebAssembly module (missing the \\0asm magic)")
    encoded_name = name.encode()
    body = encode_uleb128(len(encoded_name)) + encoded_name + payload
    return wasm + b"\x00" + encode_uleb128(len(body)) + body
