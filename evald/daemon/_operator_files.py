"""Reading a file an operator names (the config, TLS keys and certificates, a password file).

Why apart from :mod:`evald.daemon._state_files`: those are the daemon's own files, trusted to no
one, read without following links. An operator's files are theirs to place (a config linked
from ``/etc``, a key mounted by an orchestrator through a symbolic link), so links are followed;
what is refused is anything but a regular file. A FIFO named as the config would otherwise block
the thread that reads it — the control thread, on ``SIGHUP`` or ``evald reload`` — until some
process writes to it; a device or a folder is never a config either. The file is opened without
blocking (``O_NONBLOCK``), checked with ``fstat`` on the open descriptor (no window between the
check and the read), and only then read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Final

__all__ = ["file_kind", "read_regular_file"]

_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS: Final = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: "a FIFO (named pipe)", "a folder"."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def read_regular_file(path: Path | str) -> bytes:
    """The bytes of ``path`` (links followed), which must be a regular file.

    Never blocks on what the path names: a FIFO, a device or a socket is refused from its
    ``fstat`` before anything is read.

    Raises:
        OSError: missing, unreadable, or not a regular file (``strerror`` says which kind it
            is, e.g. "a FIFO (named pipe), not a regular file"); ``filename`` is ``path``.
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{file_kind(mode)}, not a regular file", str(path))
        # A regular file never blocks a read; the flag is cleared all the same.
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read()
    finally:
        os.close(fd)
