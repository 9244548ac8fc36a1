"""A token that is named but empty, blank or malformed is permission_denied on every path that
takes one (the client, the engines' client, the CLI, the local engine), never read as "no token"
(the unix socket's token-less tenant, which the daemon here would serve)."""

from __future__ import annotations

import pytest
from daemon_harness import Daemon

from engine_adapter.evaluation._client import EvaluatorClient
from evald.client import CallError, Client
from evald.contract import ErrorCode

BAD = ["", " ", "\t", "a b", "tok\n", "t\x01k", "tök"]


@pytest.mark.parametrize("token", BAD)
def test_the_clients_refuse_a_named_token_that_cannot_be_one(daemon: Daemon, token: str) -> None:
    for make in (Client, EvaluatorClient):
        with pytest.raises(CallError) as raised:
            make(daemon.target, token)
        assert raised.value.code == ErrorCode.PERMISSION_DENIED
        assert "token" in raised.value.message


def test_a_blank_evald_token_is_refused_but_an_unset_one_is_the_tokenless_tenant(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVALD_TOKEN", "  ")
    with pytest.raises(CallError) as raised:
        Client(daemon.target)
    assert raised.value.code == ErrorCode.PERMISSION_DENIED
    assert "$EVALD_TOKEN" in raised.value.message
    monkeypatch.setenv("EVALD_TOKEN", "")
    with Client(daemon.target) as client:
        assert client.list_evaluators()


@pytest.mark.parametrize("token", ["", "  "])
def test_the_cli_refuses_an_empty_or_blank_token(daemon: Daemon, token: str) -> None:
    result = daemon.cli("evaluators", "--token", token)
    assert result.returncode == 2, result.stderr
    assert "permission_denied" in result.stderr
    blank_env = daemon.cli("evaluators", env={"EVALD_TOKEN": " "})
    assert blank_env.returncode == 2 and "permission_denied" in blank_env.stderr


def test_the_local_engine_refuses_a_blank_token(daemon: Daemon) -> None:
    from engine_adapter.local import EngineError
    from engine_adapter.local._evaluator_setup import open_evaluator

    with pytest.raises(EngineError, match="permission_denied"):
        open_evaluator("evald", target=daemon.target, token=" ")
