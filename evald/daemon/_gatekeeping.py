"""What bounds a call's messages on both transports: message limits, byte budgets, typed
answers.

* :func:`receive_limit` / :func:`send_limit`: the gRPC message limits, sized from the input,
  batch and message caps.
* :class:`ResponseBudget`: the value bytes one response message may carry; a value past it
  becomes its own ``output_too_large`` (every item of a batch is answered, typed);
  :func:`pack_responses` splits a burst of stream results into messages of that budget;
* :func:`lenient` deserializers, so a malformed request is a typed ``invalid_argument``
  (:class:`Malformed`), and :func:`error_response`, an item's typed error.

Who may call and how many calls at once is :mod:`evald.daemon._grpc_gate`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from google.protobuf.message import DecodeError, Message

from evald.contract import ErrorCode, pb

__all__ = [
    "ITEM_FRAMING",
    "PROTO_CODES",
    "RESPONSE_OVERHEAD",
    "SERVICE_NAME",
    "Malformed",
    "ResponseBudget",
    "error_response",
    "lenient",
    "pack_responses",
    "receive_limit",
    "reservation",
    "send_limit",
]

#: The gRPC service every tenant call goes to (``evald.v1.Evaluator``).
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Evaluator"].full_name


#: evald's codes as the protobuf enum (the stubs type the field as ``pb.ErrorCode``).
PROTO_CODES: dict[ErrorCode, pb.ErrorCode] = {
    code: cast("pb.ErrorCode", code.proto_value) for code in ErrorCode
}


def error_response(request_id: str, code: ErrorCode, message: str) -> pb.EvaluateResponse:
    return pb.EvaluateResponse(
        id=request_id, error=pb.Error(code=PROTO_CODES[code], message=message)
    )


#: Bytes an ``EvaluateResponse`` adds to its parent message beyond its own size (tag, length).
ITEM_FRAMING = 6
#: Room for everything of a response but its value: a host or guest message (at most about
#: 1,000 characters), the code, fuel, time and semantics version.
RESPONSE_OVERHEAD = 1536


def reservation(output_bytes: int, request_id: str) -> int:
    """The most bytes one item's response can take, reserved from the unread-output budgets
    until it is sent: the tenant's output cap, the id it echoes (up to four bytes a
    character) and the rest of a response."""
    id_bytes = len(request_id) if request_id.isascii() else 4 * len(request_id)
    return output_bytes + id_bytes + RESPONSE_OVERHEAD + ITEM_FRAMING


def send_limit(max_message_bytes: int, max_batch_items: int) -> int:
    """The daemon's gRPC send limit: a full budget of values plus, for every item that did not
    fit, its error (the id it echoes was part of a request, itself at most max_message_bytes)."""
    return 2 * max_message_bytes + max_batch_items * RESPONSE_OVERHEAD


def receive_limit(max_message_bytes: int, max_batch_items: int, max_input_bytes: int) -> int:
    """The daemon's gRPC receive limit: ``max_message_bytes``, or less when the largest request
    the input and batch caps admit is smaller (gRPC refuses longer messages before parsing)."""
    largest = max_batch_items * (max_input_bytes + 2 * RESPONSE_OVERHEAD) + 64 * 1024
    return min(max_message_bytes, largest)


class ResponseBudget:
    """The value bytes one response message may still carry (thread-safe).

    A value that no longer fits is replaced by its own ``output_too_large`` error, so a batch
    whose values add up past the send limit still answers every item (never a bare
    ``RESOURCE_EXHAUSTED`` for the whole call). Errors always fit: they are small, and the send
    limit (:func:`send_limit`) leaves room for one per item.
    """

    __slots__ = ("_left", "_lock", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._left = limit
        self._lock = threading.Lock()

    def fit(self, response: pb.EvaluateResponse) -> pb.EvaluateResponse:
        size = response.ByteSize() + ITEM_FRAMING
        with self._lock:
            if size <= self._left or response.WhichOneof("outcome") != "value":
                self._left -= size
                return response
        return error_response(
            response.id,
            ErrorCode.OUTPUT_TOO_LARGE,
            f"the value ({len(response.value.encode())} bytes) does not fit in this response: "
            f"a response carries at most {self.limit} bytes (max_message_bytes); send fewer "
            "items per batch",
        )


def pack_responses(
    results: Iterable[tuple[pb.EvaluateResponse, int]], limit: int
) -> Iterator[tuple[list[pb.EvaluateResponse], int]]:
    """Splits results into response messages of at most ``limit`` value bytes each, with the
    sum of the credits (reserved output bytes) each message carries.

    A result that does not fit in the current message starts the next one; a value larger than
    a whole message becomes its own ``output_too_large``. So every item is answered, each by
    its value or its typed error, however large the burst. The gRPC stream and the data path
    both send their results through this.
    """
    budget = ResponseBudget(limit)
    batch: list[pb.EvaluateResponse] = []
    credit = 0
    for response, reserved in results:
        fitted = budget.fit(response)
        if fitted is not response and batch:  # full: send what fits, then go on
            yield batch, credit
            batch, credit = [], 0
            budget = ResponseBudget(limit)
            fitted = budget.fit(response)
        batch.append(fitted)
        credit += reserved
    if batch:
        yield batch, credit


class Malformed:
    """A request whose bytes do not parse as the method's message.

    grpc answers a deserializer that raises with an untyped ``UNKNOWN`` status (and a stream
    reader with an exception); the lenient deserializers (:func:`lenient`) return this instead,
    so the handler refuses the call with ``invalid_argument`` like any other bad request.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def lenient(message_type: type[Message]) -> Callable[[bytes], Any]:
    """A deserializer for ``message_type`` that returns a :class:`Malformed` instead of raising."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return Malformed(
                f"the request is not a valid {name} message (corrupt protobuf, or a string "
                "field that is not UTF-8); send the evald.v1 messages of proto/evald/v1"
            )

    return parse
