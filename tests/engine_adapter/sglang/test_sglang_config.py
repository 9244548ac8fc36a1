"""The adapter's environment settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapter.sglang import DEFAULT_DEADLINE_MS, AdapterConfig, ConfigError


def test_off_without_a_target() -> None:
    assert AdapterConfig.from_env({}) is None
    assert AdapterConfig.from_env({"EVALD_TARGET": "  ", "EVALD_TOKEN": "x"}) is None


def test_defaults_and_values() -> None:
    config = AdapterConfig.from_env({"EVALD_TARGET": "unix:/run/evald/evald.sock"})
    assert config == AdapterConfig("unix:/run/evald/evald.sock", None, DEFAULT_DEADLINE_MS)
    config = AdapterConfig.from_env(
        {"EVALD_TARGET": "h:1", "EVALD_TOKEN": "t", "EVALD_DEADLINE_MS": "1"}
    )
    assert config is not None and (config.token, config.deadline_ms) == ("t", 1)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "1.5"])
def test_bad_deadline_names_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match="EVALD_DEADLINE_MS"):
        AdapterConfig.from_env({"EVALD_TARGET": "h:1", "EVALD_DEADLINE_MS": value})


def test_tls_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"EVALD_TLS_CA.*no such file"):
        AdapterConfig.from_env({"EVALD_TARGET": "h:1", "EVALD_TLS_CA": str(tmp_path / "ca.pem")})
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ConfigError, match="together"):
        AdapterConfig.from_env({"EVALD_TARGET": "h:1", "EVALD_TLS_CERT": str(tmp_path / "c.pem")})


def test_inprocess_flag() -> None:
    on = AdapterConfig.from_env({"EVALD_TARGET": "h:1", "EVALD_INPROCESS": "1"})
    off = AdapterConfig.from_env({"EVALD_TARGET": "h:1"})
    assert on is not None and on.inprocess and off is not None and not off.inprocess
    with pytest.raises(ConfigError, match="EVALD_INPROCESS"):
        AdapterConfig.from_env({"EVALD_TARGET": "h:1", "EVALD_INPROCESS": "maybe"})


def test_scheduling_mode() -> None:
    from engine_adapter.sglang.plugin import scheduling_mode

    assert scheduling_mode({}) == "jump"
    assert scheduling_mode({"EVALD_SGLANG_SCHEDULING": "inline"}) == "inline"
    with pytest.raises(ConfigError, match="EVALD_SGLANG_SCHEDULING='later'"):
        scheduling_mode({"EVALD_SGLANG_SCHEDULING": "later"})
