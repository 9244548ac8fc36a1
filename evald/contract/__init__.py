"""The contract between evald's clients and its daemon: one layer under both.

Everything two sides must agree on lives here and nowhere else:

* the generated gRPC stubs (:data:`pb`, :data:`pb_grpc`, from ``proto/evald/v1/evald.proto``);
* the error codes, :class:`ErrorCode`, tied to the proto enum by name, and how they travel
  (:data:`ERROR_CODE_METADATA_KEY`, :func:`decode_rpc_error`);
* the evaluator manifest (:class:`Manifest`, :func:`parse_manifest`) and the rule that no
  evaluator can produce ``<`` (:func:`check_no_angle_bracket`);
* addresses and channels (:func:`default_target`, :func:`unix_socket_path`, :class:`Endpoint`);
* the data path's framing (:func:`encode_frame`, :func:`read_frame`, :class:`FrameWriter`).

The daemon, the host and every client import these names from ``evald.contract``; none of them
imports ``evald.v1`` directly (an import-linter contract in pyproject.toml checks it).
"""

from __future__ import annotations

from evald.contract._addresses import default_target, unix_socket_path
from evald.contract._alphabet import check_no_angle_bracket, may_produce
from evald.contract._channel import (
    CLIENT_MAX_MESSAGE_BYTES,
    Endpoint,
    RpcFailure,
    decode_rpc_error,
)
from evald.contract._errors import (
    ERROR_CODE_METADATA_KEY,
    GUEST_ERROR_CODES,
    ErrorCode,
    EvaldError,
)
from evald.contract._frames import (
    HEADER,
    HELLO_MAGIC,
    MAX_HELLO_BYTES,
    FrameError,
    FrameWriter,
    Kind,
    WriterStalled,
    encode_frame,
    read_frame,
)
from evald.contract._manifest import (
    ABI_VERSION,
    LITERAL_KINDS,
    MANIFEST_MAX_BYTES,
    MAX_EXAMPLES,
    MAX_LITERAL_RULES,
    Manifest,
    parse_manifest,
)
from evald.v1 import evald_pb2 as pb
from evald.v1 import evald_pb2_grpc as pb_grpc

__all__ = [
    "ABI_VERSION",
    "CLIENT_MAX_MESSAGE_BYTES",
    "ERROR_CODE_METADATA_KEY",
    "GUEST_ERROR_CODES",
    "HEADER",
    "HELLO_MAGIC",
    "LITERAL_KINDS",
    "MANIFEST_MAX_BYTES",
    "MAX_EXAMPLES",
    "MAX_HELLO_BYTES",
    "MAX_LITERAL_RULES",
    "Endpoint",
    "ErrorCode",
    "EvaldError",
    "FrameError",
    "FrameWriter",
    "Kind",
    "Manifest",
    "RpcFailure",
    "WriterStalled",
    "check_no_angle_bracket",
    "decode_rpc_error",
    "default_target",
    "encode_frame",
    "may_produce",
    "parse_manifest",
    "pb",
    "pb_grpc",
    "read_frame",
    "unix_socket_path",
]
