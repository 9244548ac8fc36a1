"""Files an operator names are read only if they are regular files: a FIFO in place of the
config (or a TLS file, or the store's password file) is refused at once with a message that
names it, never waited on.

The daemon test uses a real daemon and a real FIFO: before the fix, ``SIGHUP`` made the control
thread open the FIFO and block until a writer came, so no reload (nor registration) was ever
answered again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from daemon_harness import module, start_daemon, tenant_block
from fleet_harness import until

from evald.contract import EvaldError
from evald.daemon import ConfigError, StoreSettings, load_config
from evald.daemon._lifecycle import bind
from evald.daemon._operator_files import read_regular_file
from evald.daemon._server_settings import ServerSettings


def _config(*tenants: str) -> str:
    return "\n".join(["[server]", "threads = 2", "shutdown_grace_s = 2", *tenants])


def _unblock(fifo: Path) -> None:
    """Opens ``fifo`` for writing and closes it, so a reader blocked on it sees end-of-file (lets
    a daemon built without the fix shut down after the test failed)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _raised_within(call: Callable[[], object], fifo: Path, seconds: float = 20.0) -> BaseException:
    """What ``call`` raised, on a thread given ``seconds`` (a read blocked on ``fifo`` fails the
    test instead of hanging it, and is then let go)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # the refusal under test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _unblock(fifo)
        thread.join(5)
        raise AssertionError(f"blocked on the FIFO {fifo} for {seconds:g} s")
    assert raised, "nothing was refused"
    return raised[0]


def test_sighup_refuses_a_fifo_config_at_once_and_keeps_serving(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, _config(tenant_block("alpha", allow_register=True)))
    config_path = daemon.config_path
    regular = config_path.read_text()
    try:
        config_path.unlink()
        os.mkfifo(config_path)
        daemon.process.send_signal(signal.SIGHUP)
        until(
            lambda: any(
                line.get("msg") == "config not reloaded"
                and str(config_path) in str(line.get("error"))
                and "FIFO" in str(line.get("error"))
                for line in daemon.log_lines()
            ),
            "the FIFO config refused, naming its path",
        )
        # The control thread is free: a registration (which runs on it) is answered.
        daemon.client("alpha").register(module("echo", "after_fifo"))
        assert daemon.client("alpha").evaluate("after_fifo", b"ok").value == "ok"
        config_path.unlink()
        config_path.write_text(regular + "\n" + tenant_block("beta"))
        daemon.process.send_signal(signal.SIGHUP)
        until(
            lambda: any(line.get("msg") == "config reloaded" for line in daemon.log_lines()),
            "the regular config reloaded",
        )
        assert daemon.client("beta").list_evaluators() is not None
    finally:
        if config_path.is_fifo():
            _unblock(config_path)
        assert daemon.stop() == 0


def test_load_config_refuses_a_fifo_a_folder_and_a_device_naming_them(tmp_path: Path) -> None:
    fifo = tmp_path / "evald.toml"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "FIFO"), (tmp_path, "folder"), (Path("/dev/null"), "device")):
        refused = _raised_within(lambda path=path: load_config(path), fifo)
        assert isinstance(refused, ConfigError), refused
        assert str(path) in str(refused) and kind in str(refused)
        assert "not a regular file" in str(refused)


def test_a_linked_regular_config_is_still_read(tmp_path: Path) -> None:
    target = tmp_path / "real.toml"
    target.write_text(_config(tenant_block("alpha")))
    link = tmp_path / "evald.toml"
    link.symlink_to(target)
    assert load_config(link).tenant("alpha") is not None
    assert read_regular_file(link) == target.read_bytes()


def test_a_fifo_password_file_is_refused_naming_it(tmp_path: Path) -> None:
    fifo = tmp_path / "password"
    os.mkfifo(fifo)
    settings = StoreSettings(url="postgresql://evald@localhost/evald", password_file=str(fifo))
    refused = _raised_within(settings.password, fifo)
    assert isinstance(refused, ConfigError), refused
    assert str(fifo) in str(refused) and "FIFO" in str(refused)


def test_a_fifo_tls_file_is_refused_at_bind(tmp_path: Path) -> None:
    fifo = tmp_path / "server.key"
    os.mkfifo(fifo)
    cert = tmp_path / "server.crt"
    cert.write_text("not read: the key comes first")
    settings = ServerSettings(
        listen="127.0.0.1:0", tls_cert=str(cert), tls_key=str(fifo), allow_insecure_tcp=False
    )
    refused = _raised_within(lambda: bind(object(), settings.listen, settings), fifo)
    assert isinstance(refused, EvaldError), refused
    assert "FIFO" in str(refused) and str(fifo) in str(refused)
