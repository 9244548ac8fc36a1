"""The contract between evald's clients and its daemon: one layer under both.

Everything two sides must agree on lives here and nowhere else:

* the generated gRPC stubs (:data:`pb`, :data:`pb_grpc`, from ``proto/evald/v1/evald.proto``);
* the error codes, :class:`ErrorCode`, tied to the proto enum by name, and how they travel
  (:data:`ERROR_CODE_METADATA_KEY`, :func:`decode_rpc_error`);
* the evaluator ABI's names and numbers (:data:`ABI_VERSION`, :data:`MANIFEST_SECTION`, the
  exports) and the one writer of a module's custom section (:func:`append_custom_section`);
* the evaluator manifest (:class:`Manifest`, :func:`parse_manifest`), its source form and
  section payload (:func:`load_manifest_source`, :func:`encode_manifest`), the bounds of its
  optional JSON Schemas (:data:`MAX_SCHEMA_BYTES`, :data:`MAX_SCHEMA_DEPTH`), and the rule that no
  evaluator can produce ``<`` (:func:`check_no_angle_bracket`);
* the standard evaluators' names (:data:`STANDARD_EVALUATORS`);
* addresses and channels (:func:`default_target`, :func:`unix_socket_path`, :class:`Endpoint`)
  and what a bearer token may look like (:func:`check_token`, :class:`TokenError`);
* a bearer token's wire form: the ``authorization: Bearer TOKEN`` metadata
  (:func:`bearer_metadata`, read back by :func:`bearer_token`) and its SHA-256
  (:func:`token_digest`, :func:`token_sha256`), used by every client and by the daemon's gRPC
  gate, data path and config alike;
* the environment variables, each read in one place: :data:`TARGET_ENV` (:func:`env_target`)
  and :data:`TOKEN_ENV` (:func:`env_token`);
* the largest message or data-path frame a client sends or accepts
  (:data:`CLIENT_MAX_MESSAGE_BYTES`);
* the data path's framing (:func:`encode_frame`, :func:`read_frame`, :class:`FrameWriter`).

The daemon, the host and every client import these names from ``evald.contract``; none of them
imports ``evald.v1`` directly (an import-linter contract in pyproject.toml checks it).
"""

from __future__ import annotations

from evald.contract._abi import (
    ABI_VERSION,
    BUFFER_EXPORTS,
    EVAL_EXPORT,
    MANIFEST_SECTION,
    VERSION_EXPORT,
    append_custom_section,
    encode_uleb128,
)
from evald.contract._addresses import default_target, unix_socket_path
from evald.contract._alphabet import check_no_angle_bracket, may_produce
from evald.contract._bearer import (
    AUTHORIZATION_METADATA_KEY,
    BEARER_SCHEME,
    bearer_metadata,
    bearer_token,
    token_digest,
    token_sha256,
)
from evald.contract._channel import (
    CLIENT_MAX_MESSAGE_BYTES,
    Endpoint,
    RpcFailure,
    decode_rpc_error,
)
from evald.contract._environment import TARGET_ENV, TOKEN_ENV, env_target, env_token
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
from evald.contract._grammar_shape import MAX_GRAMMAR_NESTING, check_grammar_shape
from evald.contract._manifest import (
    LITERAL_KINDS,
    MANIFEST_MAX_BYTES,
    MAX_EXAMPLES,
    MAX_LITERAL_RULES,
    Manifest,
    parse_manifest,
)
from evald.contract._manifest_schemas import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
from evald.contract._manifest_source import encode_manifest, load_manifest_source
from evald.contract._standard_set import STANDARD_EVALUATORS
from evald.contract._tokens import MAX_TOKEN_CHARS, TokenError, check_token, token_problem
from evald.v1 import evald_pb2 as pb
from evald.v1 import evald_pb2_grpc as pb_grpc

__all__ = [
    "ABI_VERSION",
    "AUTHORIZATION_METADATA_KEY",
    "BEARER_SCHEME",
    "BUFFER_EXPORTS",
    "CLIENT_MAX_MESSAGE_BYTES",
    "ERROR_CODE_METADATA_KEY",
    "EVAL_EXPORT",
    "GUEST_ERROR_CODES",
    "HEADER",
    "HELLO_MAGIC",
    "LITERAL_KINDS",
    "MANIFEST_MAX_BYTES",
    "MANIFEST_SECTION",
    "MAX_EXAMPLES",
    "MAX_GRAMMAR_NESTING",
    "MAX_HELLO_BYTES",
    "MAX_LITERAL_RULES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_TOKEN_CHARS",
    "STANDARD_EVALUATORS",
    "TARGET_ENV",
    "TOKEN_ENV",
    "VERSION_EXPORT",
    "Endpoint",
    "ErrorCode",
    "EvaldError",
    "FrameError",
    "FrameWriter",
    "Kind",
    "Manifest",
    "RpcFailure",
    "TokenError",
    "WriterStalled",
    "append_custom_section",
    "bearer_metadata",
    "bearer_token",
    "check_grammar_shape",
    "check_no_angle_bracket",
    "check_token",
    "decode_rpc_error",
    "default_target",
    "encode_frame",
    "encode_manifest",
    "encode_uleb128",
    "env_target",
    "env_token",
    "load_manifest_source",
    "may_produce",
    "parse_manifest",
    "pb",
    "pb_grpc",
    "read_frame",
    "token_digest",
    "token_problem",
    "token_sha256",
    "unix_socket_path",
]
