"""Where a daemon listens: the default address, and the file behind a ``unix:`` address.

One home for both, because the daemon binds the address that clients dial when neither is
told otherwise, and every client (CLI, engines, the data path) reads ``unix:`` addresses the
same way.
"""

from __future__ import annotations

import os
from pathlib import Path

from evald.contract._environment import env_target

__all__ = ["default_target", "unix_socket_path"]


def default_target() -> str:
    """The address ``evald serve`` listens on and ``evald call`` dials when none is given.

    ``$EVALD_TARGET`` when set; otherwise ``unix:$XDG_RUNTIME_DIR/evald.sock`` when
    ``$XDG_RUNTIME_DIR`` is set (a private per-user folder, so no other user can squat the path),
    else ``unix:/tmp/evald-$UID.sock``.
    """
    env = env_target()
    if env:
        return env
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime_dir and Path(runtime_dir).is_dir():
        return f"unix:{Path(runtime_dir) / 'evald.sock'}"
    return f"unix:/tmp/evald-{os.getuid()}.sock"


def unix_socket_path(target: str) -> Path | None:
    """The file of a ``unix:PATH`` or ``unix:///PATH`` address, made absolute.

    None for TCP addresses, abstract socket names and an empty path.
    """
    if not target.startswith("unix:") or target.startswith("unix-abstract:"):
        return None
    raw = target[len("unix:") :]
    if raw.startswith("//"):
        raw = raw[2:]
    return Path(raw).expanduser().absolute() if raw else None
