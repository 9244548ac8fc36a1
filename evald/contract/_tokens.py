"""What a bearer token may look like, for every path that takes one (clients, CLI, engines).

A token travels as ``authorization: Bearer TOKEN`` (gRPC metadata, printable ASCII) and the
daemon stores only its SHA-256. The rule here is the one place that says which strings can be a
token at all, so that a token that was *named* but is empty, blank or garbled is refused where it
is named, and never read as "no token" (which on the unix socket is the token-less tenant).
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_TOKEN_CHARS", "TokenError", "check_token", "token_problem"]

#: The longest token a client sends. ``evald hash-token`` makes 43-character tokens; a few KiB
#: leaves room for any operator's scheme while keeping a header small.
MAX_TOKEN_CHARS: Final = 4096


class TokenError(ValueError):
    """A named token that cannot be one; the message says why and never repeats the token.

    Callers report it as ``permission_denied`` (``ErrorCode.PERMISSION_DENIED``): a malformed
    credential is a credential that grants nothing.
    """


def token_problem(token: object) -> str | None:
    """Why ``token`` cannot be a bearer token (a phrase that follows "the token"), or None.

    A token is 1 to :data:`MAX_TOKEN_CHARS` printable ASCII characters without spaces: what an
    HTTP/2 header carries unchanged. The phrase describes the value without quoting it.
    """
    if not isinstance(token, str):
        return f"is a {type(token).__name__}, not a string"
    if not token:
        return "is empty"
    if not token.strip():
        return "is blank (only whitespace)"
    if len(token) > MAX_TOKEN_CHARS:
        return f"is longer than {MAX_TOKEN_CHARS} characters"
    for index, char in enumerate(token):
        if not "\x21" <= char <= "\x7e":
            kind = "whitespace" if char.isspace() else "a control or non-ASCII character"
            return f"holds {kind} at position {index} (a token is printable ASCII without spaces)"
    return None


def check_token(token: object, *, where: str = "the token") -> str:
    """``token`` itself, if it can be a bearer token.

    Raises:
        TokenError: it cannot (``where`` names the setting in the message, e.g. ``--token``).
    """
    problem = token_problem(token)
    if problem is not None:
        raise TokenError(f"{where} {problem}; give a tenant token, or name none")
    assert isinstance(token, str)
    return token
