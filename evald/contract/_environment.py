"""The environment variables evald's clients and daemon read, and the one reader of each.

Why one home: ``$EVALD_TARGET`` and ``$EVALD_TOKEN`` are read by the CLI, both clients, the
daemon (its default address) and the engines' adapters. Read in several places, each grew its
own idea of what an empty or blank value means; here an unset variable and one set to nothing
(or, for the target, to whitespace) both mean "not given", and nothing else is decided: a
token that is given is checked where it is used (:func:`~evald.contract.check_token`), so the
message can name ``$EVALD_TOKEN``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

__all__ = ["TARGET_ENV", "TOKEN_ENV", "env_target", "env_token"]

#: The daemon's address when none is named (``unix:PATH`` or ``HOST:PORT``).
TARGET_ENV: Final = "EVALD_TARGET"
#: The bearer token a client presents when none is named.
TOKEN_ENV: Final = "EVALD_TOKEN"


def env_target(environ: Mapping[str, str] | None = None) -> str | None:
    """``$EVALD_TARGET`` without surrounding whitespace; None when unset or blank.

    ``environ``: the variables to read (default ``os.environ``; a server adapter passes the
    environment it was started with).
    """
    value = (os.environ if environ is None else environ).get(TARGET_ENV, "").strip()
    return value or None


def env_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``$EVALD_TOKEN`` as set (not stripped: a blank token is refused where it is used, never
    read as none); None when unset or set to nothing."""
    value = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    return value or None
