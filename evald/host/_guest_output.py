"""Reading what the guest returned: a value, or its own error, checked against ABI v1.

``evald_eval`` returns a length: ``n >= 0`` is a UTF-8 value of ``n`` bytes in the output
buffer, ``-n`` an error payload of ``n`` bytes there, ``code:message``. Nothing the guest
returns is trusted: the length must fit the output buffer and ``output_bytes``, the bytes must
be UTF-8, and the code must be one a guest may return. The call path reads the common case (a
value inside the buffer) inline and comes here for everything else.
"""

from __future__ import annotations

from typing import Final

from evald.contract import GUEST_ERROR_CODES, ErrorCode
from evald.host._instance import Instance
from evald.host._limits import Limits
from evald.host._outcome import Failure

__all__ = ["read_output"]

#: A guest's error message is cut to this many characters.
_MAX_MESSAGE_CHARS: Final = 1000
#: The codes a guest may return in its error payload, by their text.
_GUEST_CODES: Final = {code.value: code for code in GUEST_ERROR_CODES}


def read_output(instance: Instance, result: int, limits: Limits, fuel_used: int) -> str:
    """The guest's value, checked: ``result`` is its length (an error payload's, negated).

    Only the guest error codes (``syntax``, ``domain``, …) may come from a guest: a code the
    host reserves for itself (``permission_denied``, ``fuel_exhausted``, …) would let a module
    impersonate the daemon, so it is a ``guest_fault`` like any unknown code.

    Raises:
        Failure: ``GUEST_FAULT`` for a length past the output buffer, an output outside the
            memory, bytes that are not UTF-8 or an unknown code; ``OUTPUT_TOO_LARGE`` past
            ``output_bytes``; the guest's own code for its error payload.
    """
    name = instance.module.manifest.name
    length = abs(result)
    if length > instance.out_cap:
        raise Failure(
            ErrorCode.GUEST_FAULT,
            f"evaluator {name} returned {result}, but its output buffer holds "
            f"{instance.out_cap} bytes",
            fuel_used,
        )
    if length > limits.output_bytes:
        kind = "value" if result >= 0 else "error payload"
        raise Failure(
            ErrorCode.OUTPUT_TOO_LARGE,
            f"evaluator {name} produced a {kind} of {length} bytes; the limit "
            f"is {limits.output_bytes} bytes (output_bytes)",
            fuel_used,
        )
    out_ptr = instance.out_ptr
    if out_ptr + length > instance.view_size:
        raise Failure(
            ErrorCode.GUEST_FAULT, f"evaluator {name}'s output lies outside its memory", fuel_used
        )
    try:
        text = str(instance.view[out_ptr : out_ptr + length], "utf-8")
    except UnicodeDecodeError as exc:
        raise Failure(
            ErrorCode.GUEST_FAULT,
            f"evaluator {name} returned bytes that are not UTF-8 "
            f"({exc.reason} at byte {exc.start})",
            fuel_used,
        ) from None
    if result >= 0:
        return text
    code_text, _, message = text.partition(":")
    code = _GUEST_CODES.get(code_text)
    if code is None:
        shown = code_text[:40]
        raise Failure(
            ErrorCode.GUEST_FAULT,
            f"evaluator {name} returned an error with the unknown code "
            f"{shown!r}; guests may return only "
            f"{', '.join(sorted(_GUEST_CODES))}",
            fuel_used,
        )
    raise Failure(code, message[:_MAX_MESSAGE_CHARS] or f"{name}: {code.value}", fuel_used)
