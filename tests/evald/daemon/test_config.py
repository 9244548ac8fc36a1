"""The daemon config: defaults that work, overrides that inherit, errors that name the key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from evald.daemon._config import (
    DEFAULT_CONFIG_PATH,
    MIB,
    ConfigError,
    default_target,
    hash_token,
    load_config,
    parse_config,
    parse_size,
)

TOKEN_HASH = hash_token("secret-token")


def test_packaged_default_serves_the_local_tenant_with_every_standard_evaluator() -> None:
    config = load_config(DEFAULT_CONFIG_PATH)
    local = config.tenant("local")
    assert local is not None
    assert local.tokenless
    assert local.may_use_standard("calc") and local.may_use_standard("checksum")
    assert config.server.socket_mode == 0o600
    assert config.server.metrics_listen == ""
    assert config.default_limits.deadline_ms == 100
    assert config.host.module_bytes == 4 * MIB


def test_empty_config_is_all_defaults_and_no_tenant() -> None:
    config = parse_config("")
    assert config.tenants == ()
    assert config.default_limits.fuel == 200_000_000


def test_tenant_limits_inherit_defaults_and_override_some() -> None:
    config = parse_config(
        f"""
        [defaults.limits]
        fuel = 1000
        memory_bytes = "2MiB"
        [[tenants]]
        name = "team-a"
        token_sha256 = "{TOKEN_HASH}"
        [tenants.limits]
        deadline_ms = 7
        rate_per_s = 2.5
        """
    )
    tenant = config.tenant("team-a")
    assert tenant is not None
    assert tenant.limits.fuel == 1000
    assert tenant.limits.memory_bytes == 2 * MIB
    assert tenant.limits.deadline_ms == 7
    assert tenant.limits.rate_per_s == 2.5
    assert tenant.limits.effective_burst == 3  # one second's worth, rounded up
    assert not tenant.allow_register
    assert tenant.evaluators == ()
    assert not tenant.may_use_standard("calc")


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[server]\nlistn = 'x'", "server.listn"),
        ("[host]\nstack = 1", "host.stack"),
        ("[defaults.limits]\nfule = 1", "defaults.limits.fule"),
        ("[[tenants]]\nname = 'a'\n[tenants.limits]\nfule = 1", "tenants[0].limits.fule"),
        ("[[tenants]]\nname = 'a'\ncolour = 'red'", "tenants[0].colour"),
        ("[[tenants]]\nname = 'a'\n[tenants.limits]\nfuel = 'lots'", "tenants[0].limits.fuel"),
        ("[[tenants]]\nname = 'a'\n[tenants.limits]\nfuel = -1", "tenants[0].limits.fuel"),
        ("[[tenants]]\nname = 'a'\n[tenants.limits]\nmemory_bytes = '3 parsecs'", "memory_bytes"),
        ("[[tenants]]\nname = 'A b'", "tenants[0].name"),
        ("[[tenants]]\nname = 'a'\ntoken_sha256 = 'abc'", "tenants[0].token_sha256"),
        ("[[tenants]]\nname = 'a'\nevaluators = ['nope']", "tenants[0].evaluators"),
        ("[[tenants]]\nname = 'a'\nallow_register = 'yes'", "tenants[0].allow_register"),
        ("[server]\nsocket_mode = '9999'", "server.socket_mode"),
        ("[server]\nlog_level = 'loud'", "server.log_level"),
        ("[server]\ntls_cert = 'c.pem'", "server.tls_cert"),
        ("[server]\nlisten = 'nowhere'", "server.listen"),
        ("[host]\nisolation = 'shared'", "host.isolation"),
        ("tenants = 3", "tenants"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_invalid_config_names_the_bad_key(text: str, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "my.toml")
    message = str(info.value)
    assert message.startswith("my.toml: ")
    assert names in message


def test_tenant_set_must_be_consistent() -> None:
    with pytest.raises(ConfigError, match="duplicate tenant 'a'"):
        parse_config("[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'a'")
    with pytest.raises(ConfigError, match="at most one tenant may have no token_sha256"):
        parse_config("[[tenants]]\nname = 'a'\n[[tenants]]\nname = 'b'")
    same = f"token_sha256 = '{TOKEN_HASH}'"
    with pytest.raises(ConfigError, match="same token is given to two tenants"):
        parse_config(f"[[tenants]]\nname = 'a'\n{same}\n[[tenants]]\nname = 'b'\n{same}")


def test_sizes_accept_bytes_and_binary_units() -> None:
    assert parse_size(17) == 17
    assert parse_size("256KiB") == 256 * 1024
    assert parse_size("4 MiB") == 4 * MIB
    for bad in ("4MB", "-1", True, 1.5):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_hash_token_is_the_sha256_hex_of_the_token() -> None:
    assert hash_token("secret-token") == hashlib.sha256(b"secret-token").hexdigest()


def test_load_config_reports_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path / "absent.toml")


def test_default_target_prefers_env_then_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVALD_TARGET", "unix:/somewhere/x.sock")
    assert default_target() == "unix:/somewhere/x.sock"
    monkeypatch.delenv("EVALD_TARGET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_target() == f"unix:{tmp_path / 'evald.sock'}"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    import os

    assert default_target() == f"unix:/tmp/evald-{os.getuid()}.sock"


def test_command_line_overrides_win(tmp_path: Path) -> None:
    config = parse_config("[server]\nlisten = 'unix:/a.sock'\nstate_dir = '/a'")
    overridden = config.with_overrides(listen="127.0.0.1:5000", state_dir=str(tmp_path))
    assert overridden.server.resolved_listen == "127.0.0.1:5000"
    assert overridden.server.resolved_state_dir == tmp_path
    assert not overridden.server.is_unix


def test_the_store_is_embedded_by_default_and_postgresql_when_a_url_is_given(
    tmp_path: Path,
) -> None:
    assert not load_config(DEFAULT_CONFIG_PATH).store.fleet
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    config = parse_config(
        f'[store]\nurl = "postgresql://pod@db:5432/evald"\npassword_file = "{secret}"'
    )
    assert config.store.fleet and config.store.password() == "s3cret"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://pod:hunter2@db/evald", "carries a password"),
        ("postgresql://pod@db/evald?password=hunter2", "carries a password"),
        ("mysql://pod@db/evald", "expected a postgresql:// URL"),
    ],
)
def test_a_store_url_with_a_password_or_another_scheme_is_refused_without_echo(
    url: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected) as refused:
        parse_config(f'[store]\nurl = "{url}"')
    assert "hunter2" not in str(refused.value)


def test_a_tenant_may_hold_several_token_hashes_but_no_two_tenants_one() -> None:
    other = hash_token("other")
    config = parse_config(
        f'[[tenants]]\nname = "a"\ntoken_sha256 = "{TOKEN_HASH}"\ntoken_sha256s = ["{other}"]'
    )
    assert config.tenants[0].token_sha256s == (TOKEN_HASH, other)
    with pytest.raises(ConfigError, match="the same token is given to two tenants"):
        parse_config(
            f'[[tenants]]\nname = "a"\ntoken_sha256s = ["{other}"]\n'
            f'[[tenants]]\nname = "b"\ntoken_sha256 = "{other}"'
        )


def test_the_embedded_store_needs_no_psycopg() -> None:
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['psycopg'] = None; sys.modules['psycopg_pool'] = None\n"
        "import evald.daemon, evald.cli\n"
        "from evald.cli import main\n"
        "sys.exit(main(['tenants', 'list', '--config', sys.argv[1]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(DEFAULT_CONFIG_PATH)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("local: tokens -")
