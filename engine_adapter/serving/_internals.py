"""Which of an engine's internals a plugin relies on are missing from the installed engine.

Why: both plugins reach into their engine's scheduler (attributes set in ``__init__``, fields of
request and batch classes, configuration fields) that no public API promises. A release that
renames one would otherwise fail mid-request with an ``AttributeError`` on the scheduler's
thread; checked at start-up, the server refuses to start and names what is missing. One check
serves both plugins, each with its own table of what it uses.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import pkgutil
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["installed_version", "missing_internals", "warn_if_other_version"]


def missing_internals(internals: Mapping[str, Sequence[str]]) -> list[str]:
    """The ``owner.name`` entries of ``internals`` that this environment lacks.

    Parameters:
        internals: a dotted class or module path (``pkgutil.resolve_name`` syntax) to the
            attribute names a plugin uses on it.

    Returns:
        ``owner`` for an owner that does not resolve, ``owner.name`` for a name it does not
        have; empty when everything is there. A name counts as there when it is on the class
        (methods, properties, class attributes), assigned in its ``__init__`` or in an
        ``init_*`` / ``_init*`` helper (names the code stores), or a dataclass, msgspec or
        pydantic field.
    """
    missing: list[str] = []
    for owner, names in internals.items():
        try:
            found = pkgutil.resolve_name(owner)
        except (ImportError, AttributeError, ValueError):
            missing.append(owner)
            continue
        known = _known_names(found)
        missing += [f"{owner}.{name}" for name in names if name not in known]
    return missing


def _known_names(found: Any) -> set[str]:
    known = set(dir(found))
    init = getattr(found, "__init__", None)
    if callable(init):
        init = inspect.unwrap(init)  # a plugin's own hook around __init__ names its names
    code = getattr(init, "__code__", None)
    if code is not None:
        known.update(code.co_names)
    known.update(getattr(found, "__dataclass_fields__", {}))
    known.update(getattr(found, "__struct_fields__", ()))
    known.update(getattr(found, "model_fields", None) or {})
    known.update(_assigned_in_init_helpers(found))
    return known


def _assigned_in_init_helpers(cls: Any) -> set[str]:
    """Attribute names the ``init_*`` methods a constructor calls store."""
    names: set[str] = set()
    for attr in dir(cls):
        if attr.startswith("init_") or attr.startswith("_init"):
            code = getattr(getattr(cls, attr, None), "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return names


def installed_version(*distributions: str) -> str:
    """The version of the first of ``distributions`` that is installed (a local build tag such
    as ``+cpu`` dropped), or ``"unknown"``."""
    for name in distributions:
        try:
            return importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def warn_if_other_version(
    logger: logging.Logger, engine: str, written_for: str, distributions: tuple[str, ...]
) -> str:
    """Logs a warning when the engine installed is not the release the plugin was written
    for (the internals are checked, but the order of the engine's calls is only known for that
    release); returns the installed version."""
    version = installed_version(*distributions)
    if version != written_for:
        logger.warning(
            "evald %s adapter: written against %s==%s, running on %s; the internals it uses "
            "are checked at start-up, but the engine's call order is only known for %s",
            engine,
            distributions[-1],
            written_for,
            version,
            written_for,
        )
    return version
