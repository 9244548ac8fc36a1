"""The start-up check of an engine's internals: what counts as present, and what is named."""

from __future__ import annotations

import logging

import pytest

from engine_adapter.serving._internals import (
    installed_version,
    missing_internals,
    warn_if_other_version,
)


def test_methods_init_assignments_and_dataclass_fields_count_as_present() -> None:
    assert (
        missing_internals(
            {
                "threading.Thread": ("start", "name", "_target"),  # method, property, __init__
                # fields
                "engine_adapter.serving._server_config.AdapterConfig": ("target", "token"),
            }
        )
        == []
    )


def test_a_missing_name_and_a_missing_owner_are_named() -> None:
    assert missing_internals(
        {
            "threading.Thread": ("start", "renamed_in_a_new_release"),
            "threading.NoSuchClass": ("start",),
        }
    ) == ["threading.Thread.renamed_in_a_new_release", "threading.NoSuchClass"]


def test_another_engine_version_is_warned_about_and_the_installed_one_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test-internals")
    pytest_version = installed_version("no-such-distribution", "pytest")
    assert pytest_version == pytest.__version__.split("+")[0]
    with caplog.at_level(logging.WARNING, logger="test-internals"):
        assert warn_if_other_version(logger, "Test", pytest_version, ("pytest",)) == pytest_version
        assert not caplog.records
        warn_if_other_version(logger, "Test", "0.0.1", ("pytest",))
    assert "written against pytest==0.0.1, running on " + pytest_version in caplog.text
    assert installed_version("no-such-distribution") == "unknown"
