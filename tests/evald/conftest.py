"""Fixtures for the evald tests: the WAT module generator and a shared real daemon.

``wat_modules`` and ``daemon_harness`` live next to this file; its folder is put on ``sys.path``
so test modules import them by name whatever the pytest import mode.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_harness import Daemon, free_port, session_config, start_daemon


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the session, with a tenant per concern (see ``session_config``)."""
    port = free_port()
    handle = start_daemon(
        tmp_path_factory.mktemp("daemon"), session_config(port), metrics_port=port
    )
    try:
        yield handle
    finally:
        status = handle.stop()
        assert status == 0, handle.log_path.read_text()
