"""The token's wire form has one home: what a client writes is what the daemon reads back, and
a token's hash is the one a config holds."""

from __future__ import annotations

import hashlib

import pytest

from evald.contract import (
    TARGET_ENV,
    TOKEN_ENV,
    Endpoint,
    TokenError,
    bearer_metadata,
    bearer_token,
    env_target,
    env_token,
    token_digest,
    token_sha256,
)
from evald.daemon import hash_token


def test_the_header_a_client_writes_is_read_back_as_its_token() -> None:
    token = "alpha-token-0123456789"
    assert bearer_metadata(token) == (("authorization", f"Bearer {token}"),)
    assert Endpoint.resolve("unix:/x", token).metadata == bearer_metadata(token)
    assert bearer_token(bearer_metadata(token)) == token
    assert bearer_token([("authorization", b"bearer  spaced-token ")]) == "spaced-token"
    assert bearer_metadata(None) == bearer_metadata("") == ()
    assert bearer_token(()) is None and bearer_token(None) is None


@pytest.mark.parametrize("value", ["Basic abc", "Bearer", "Bearer    ", "", "token-only"])
def test_authorization_that_is_not_bearer_token_is_refused(value: str) -> None:
    with pytest.raises(TokenError, match="malformed authorization metadata"):
        bearer_token([("authorization", value)])


def test_one_hash_for_the_config_the_daemon_and_the_contract() -> None:
    token = "ünïcode-token"
    expected = hashlib.sha256(token.encode("utf-8"))
    assert token_digest(token) == expected.digest()
    assert token_sha256(token) == hash_token(token) == expected.hexdigest()


def test_the_environment_is_read_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TARGET_ENV, "  unix:/run/evald.sock ")
    monkeypatch.setenv(TOKEN_ENV, " blank-edged ")
    assert env_target() == "unix:/run/evald.sock"
    assert env_token() == " blank-edged "  # checked where it is used, never read as none
    with pytest.raises(TokenError, match=r"\$EVALD_TOKEN"):
        Endpoint.resolve("unix:/x")
    monkeypatch.setenv(TARGET_ENV, "   ")
    monkeypatch.setenv(TOKEN_ENV, "")
    assert env_target() is None and env_token() is None
    assert env_target({TARGET_ENV: "h:1"}) == "h:1" and env_token({}) is None
