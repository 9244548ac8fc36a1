"""How a client reaches a daemon over gRPC, and how it reads a refusal.

Both clients (the blocking :class:`evald.client.Client` and the engines' streaming
``engine_adapter.EvaluatorClient``) dial through an :class:`Endpoint` and decode failed calls
with :func:`decode_rpc_error`, so the address and token defaults, TLS set-up and the reading of
the ``evald-error-code`` trailer have one home.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NamedTuple

import grpc

from evald.contract._addresses import default_target
from evald.contract._bearer import bearer_metadata
from evald.contract._environment import TOKEN_ENV
from evald.contract._environment import env_token as _env_token
from evald.contract._errors import ERROR_CODE_METADATA_KEY, ErrorCode
from evald.contract._tokens import check_token

__all__ = ["CLIENT_MAX_MESSAGE_BYTES", "Endpoint", "RpcFailure", "decode_rpc_error"]

PathLike = str | os.PathLike[str]

#: The largest message a client sends or accepts by default. Above the daemon's own send limit
#: with its default settings (twice ``[server] max_message_bytes`` plus an error per batch item),
#: so a client never refuses an answer its daemon is allowed to give.
CLIENT_MAX_MESSAGE_BYTES: Final = 64 * 2**20


@dataclass(frozen=True)
class Endpoint:
    """A daemon's address with the credentials to present to it.

    Build it with :meth:`resolve`, which applies the defaults: the target from
    :func:`~evald.contract.default_target`, the token from ``$EVALD_TOKEN`` (none is needed on
    the unix socket for the token-less local tenant).
    """

    target: str
    token: str | None = field(default=None, repr=False)
    """Never in a repr: an endpoint may be logged."""
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def resolve(
        cls,
        target: str | None = None,
        token: str | None = None,
        *,
        tls_ca: PathLike | None = None,
        tls_cert: PathLike | None = None,
        tls_key: PathLike | None = None,
        env_token: bool = True,
    ) -> Endpoint:
        """The endpoint for these arguments, defaults applied.

        Only a token that is not named at all means none: ``token=None`` and ``$EVALD_TOKEN``
        unset (or set to nothing). A named token that is empty, blank or malformed is refused,
        never read as "no token", which on the unix socket is the token-less tenant.
        ``env_token=False``: ``$EVALD_TOKEN`` is not read (a caller that already applied its
        own default, such as an engine adapter that sends the server's token to the default
        address only).

        Raises:
            TokenError: the named token cannot be one (the message says why, not what it is).
        """
        resolved: str | None
        if token is not None:
            resolved = check_token(token, where="the token")
        else:
            from_env = _env_token() if env_token else None
            resolved = check_token(from_env, where=f"${TOKEN_ENV}") if from_env else None
        return cls(
            target=target or default_target(),
            token=resolved,
            tls_ca=Path(tls_ca) if tls_ca else None,
            tls_cert=Path(tls_cert) if tls_cert else None,
            tls_key=Path(tls_key) if tls_key else None,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that authenticates: ``authorization: Bearer TOKEN``, or nothing."""
        return bearer_metadata(self.token)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials when a CA or a client certificate is set; None for plain channels.

        Raises:
            OSError: a PEM file cannot be read.
        """
        if self.tls_ca is None and self.tls_cert is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca.read_bytes() if self.tls_ca else None,
            private_key=self.tls_key.read_bytes() if self.tls_key else None,
            certificate_chain=self.tls_cert.read_bytes() if self.tls_cert else None,
        )

    def channel(
        self,
        *,
        max_message_bytes: int,
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> grpc.Channel:
        """A new channel to the daemon, capped at ``max_message_bytes`` each way.

        ``credentials`` saves re-reading the PEM files when a client reconnects; by default they
        come from :meth:`credentials`.
        """
        all_options = (
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *options,
        )
        credentials = credentials if credentials is not None else self.credentials()
        if credentials is not None:
            return grpc.secure_channel(self.target, credentials, options=all_options)
        return grpc.insecure_channel(self.target, options=all_options)


class RpcFailure(NamedTuple):
    """A failed call as the daemon meant it.

    ``code`` is the daemon's own error code from the ``evald-error-code`` trailer (``internal``
    for a name this client does not know), or None when the failure carries none: the call did
    not reach evald's handlers (unreachable, timed out, refused by gRPC itself).
    """

    status: grpc.StatusCode
    details: str
    code: ErrorCode | None


def decode_rpc_error(error: grpc.RpcError) -> RpcFailure:
    """The status, details and evald error code of a failed gRPC call."""
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(status)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_CODE_METADATA_KEY:
            try:
                return RpcFailure(status, details, ErrorCode(value))
            except ValueError:
                return RpcFailure(status, details, ErrorCode.INTERNAL)
    return RpcFailure(status, details, None)
