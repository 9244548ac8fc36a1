"""The start-up check of an engine's internals: what counts as present, and what is named."""

from __future__ import annotations

from engine_adapter._internals import missing_internals


def test_methods_init_assignments_and_dataclass_fields_count_as_present() -> None:
    assert (
        missing_internals(
            {
                "threading.Thread": ("start", "name", "_target"),  # method, property, __init__
                "engine_adapter._server_config.AdapterConfig": ("target", "token"),  # fields
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
