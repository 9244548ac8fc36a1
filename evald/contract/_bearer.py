"""A bearer token's wire form: the ``authorization: Bearer TOKEN`` metadata and the SHA-256.

Why one home: a token crosses three doors (a gRPC call's metadata, the data path's HELLO frame,
an operator's config), and the daemon compares what each door carries with the hashes it holds.
If the header were written in one place and read in another with a different rule (a lower-case
scheme, a stray space, a missing digest step), a token accepted on one door would be refused on
the other. So the header is built by :func:`bearer_metadata`, read back by
:func:`bearer_token`, and a token's identity is :func:`token_digest` (the bytes compared in
constant time) and :func:`token_sha256` (the hex a config's ``token_sha256`` holds): every
client, the daemon's gRPC gate, its data path and its config use these and nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

from evald.contract._tokens import TokenError

__all__ = [
    "AUTHORIZATION_METADATA_KEY",
    "BEARER_SCHEME",
    "bearer_metadata",
    "bearer_token",
    "token_digest",
    "token_sha256",
]

#: The gRPC metadata key that carries the credential (lower case, as HTTP/2 sends it).
AUTHORIZATION_METADATA_KEY: Final = "authorization"
#: The scheme word before the token; read back case-insensitively.
BEARER_SCHEME: Final = "Bearer"

MetadataItems = Iterable[tuple[str, str | bytes]]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token``: ``(("authorization", "Bearer TOKEN"),)``, or
    nothing for no token (an empty string is no token too)."""
    return ((AUTHORIZATION_METADATA_KEY, f"{BEARER_SCHEME} {token}"),) if token else ()


def _authorization(metadata: MetadataItems | None) -> str | None:
    """The ``authorization`` value of a call's metadata, if any (bytes read as latin-1)."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_METADATA_KEY:
            return value if isinstance(value, str) else bytes(value).decode("latin-1")
    return None


def bearer_token(metadata: MetadataItems | None) -> str | None:
    """The token a call's metadata presents; None when it carries no ``authorization`` at all.

    The scheme is matched case-insensitively and whitespace around the scheme and the token is
    dropped, as HTTP's own rule for the header reads it.

    Raises:
        TokenError: the metadata holds ``authorization`` but not ``Bearer TOKEN``.
    """
    authorization = _authorization(metadata)
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER_SCHEME.lower() or not token:
        raise TokenError(f"malformed authorization metadata: expected `{BEARER_SCHEME} TOKEN`")
    return token


def token_digest(token: str) -> bytes:
    """The SHA-256 of ``token`` (UTF-8): what the daemon compares, in constant time.

    Tokens are long random strings (``evald hash-token`` makes them), so an unsalted hash is
    enough to keep a config file or a store from being a credential.
    """
    return hashlib.sha256(token.encode("utf-8")).digest()


def token_sha256(token: str) -> str:
    """The hex SHA-256 of ``token``: what a tenant's ``token_sha256`` holds."""
    return token_digest(token).hex()
