"""The stable error codes of evald and how they cross each boundary.

Inside the daemon errors are exceptions carrying an :class:`ErrorCode`; at the gRPC boundary they
become the ``evald.v1.ErrorCode`` enum (per evaluation) or a gRPC status plus the trailing
metadata ``evald-error-code`` (per call). The lower-case names are a public contract: they appear
in ``<result_error>CODE</result_error>``, in ``evald call`` output and in metric labels.
"""

from __future__ import annotations

import enum

import grpc

from evald.v1 import evald_pb2 as _pb

__all__ = [
    "ERROR_CODE_METADATA_KEY",
    "GUEST_ERROR_CODES",
    "ErrorCode",
    "EvaldError",
]

ERROR_CODE_METADATA_KEY = "evald-error-code"


class ErrorCode(enum.StrEnum):
    """One value per ``evald.v1.ErrorCode``; ``value`` is the lower-case public name."""

    SYNTAX = "syntax"
    DIVISION_BY_ZERO = "division_by_zero"
    OVERFLOW = "overflow"
    DOMAIN = "domain"
    TOO_LARGE = "too_large"
    FUEL_EXHAUSTED = "fuel_exhausted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    MEMORY_LIMIT = "memory_limit"
    STACK_OVERFLOW = "stack_overflow"
    GUEST_FAULT = "guest_fault"
    INPUT_TOO_LARGE = "input_too_large"
    OUTPUT_TOO_LARGE = "output_too_large"
    UNKNOWN_EVALUATOR = "unknown_evaluator"
    PERMISSION_DENIED = "permission_denied"
    QUOTA_EXCEEDED = "quota_exceeded"
    UNAVAILABLE = "unavailable"
    INVALID_MODULE = "invalid_module"
    INVALID_ARGUMENT = "invalid_argument"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"

    @property
    def proto_value(self) -> int:
        """The ``evald.v1.ErrorCode`` number: the proto member ``ERROR_CODE_<NAME>``'s."""
        return _PROTO_NUMBERS[self]

    @classmethod
    def from_proto(cls, number: int) -> ErrorCode:
        """Maps an ``evald.v1.ErrorCode`` number back; unknown numbers become ``INTERNAL``."""
        return _FROM_PROTO.get(number, cls.INTERNAL)

    @property
    def grpc_status(self) -> grpc.StatusCode:
        """The gRPC status used when this code fails a whole call."""
        return _GRPC_STATUS.get(self, grpc.StatusCode.INVALID_ARGUMENT)


def _proto_numbers() -> dict[ErrorCode, int]:
    """Each member's wire number, looked up by name in the generated proto enum.

    Matching by name (never by declaration order) means reordering or inserting members here
    cannot renumber the wire; a member without a proto counterpart fails at import.
    """
    numbers: dict[ErrorCode, int] = {}
    for code in ErrorCode:
        proto_name = f"ERROR_CODE_{code.name}"
        try:
            numbers[code] = _pb.ErrorCode.Value(proto_name)
        except ValueError:
            raise ImportError(
                f"ErrorCode.{code.name} has no {proto_name} in proto/evald/v1/evald.proto"
            ) from None
    return numbers


_PROTO_NUMBERS = _proto_numbers()
_FROM_PROTO = {number: code for code, number in _PROTO_NUMBERS.items()}
_GRPC_STATUS = {
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.UNKNOWN_EVALUATOR: grpc.StatusCode.NOT_FOUND,
    ErrorCode.QUOTA_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.INVALID_MODULE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.INPUT_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
}

#: Codes a guest may return from ``evald_eval`` (docs/abi.md); every other code is the host's.
GUEST_ERROR_CODES = frozenset(
    {
        ErrorCode.SYNTAX,
        ErrorCode.DIVISION_BY_ZERO,
        ErrorCode.OVERFLOW,
        ErrorCode.DOMAIN,
        ErrorCode.TOO_LARGE,
    }
)


class EvaldError(Exception):
    """An error with a stable code and a message a person can act on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
