"""Reading and writing the daemon's own files under its state folder, trusting none of them.

Why one module: the state folder is a file tree anyone with write access to it can change, and
everything the daemon reads back from it (a tenant's index, a module, the fleet store's local
cache) must be read the same careful way. Each read here:

* opens the file without following a link (``O_NOFOLLOW``: a tenant's index linked to another
  tenant's is refused, not served to the wrong tenant), without blocking (``O_NONBLOCK``: a FIFO
  put in place of a module never hangs the start), and takes only a regular file;
* reads at most ``max_bytes`` (a 39 MB index is refused from its size, unread);
* for JSON, refuses nesting past ``max_depth`` before parsing (an index nested 200,000 deep never
  reaches the parser's recursion);
* for content-addressed bytes, checks them against the SHA-256 they are named by.

A refusal is a :class:`StateFileError` (``unavailable``) with a short message that names the file
and never quotes it, so a bad file costs one log line of bounded length. Writes go to a temporary
file in the same folder, are fsynced, renamed over the target and the folder fsynced, so a crash
or a full disk leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Final

from evald.contract import ErrorCode, EvaldError

__all__ = [
    "TMP_MARK",
    "StateFileError",
    "atomic_write",
    "describe_os_error",
    "json_depth",
    "read_bytes",
    "read_content_addressed",
    "read_json",
]

#: Marks a temporary file being written (removed by garbage collection after a crash).
TMP_MARK: Final = ".tmp-"
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StateFileError(EvaldError):
    """A state file is missing, unreadable, not a regular file, too large, malformed or does
    not match its hash; nothing was changed."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)
        self.missing = missing


def describe_os_error(exc: OSError) -> str:
    """An OS error in words an operator can act on (a full disk, a file-size limit)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{exc.strerror} (free space in the daemon's state folder)"
    if exc.errno == errno.EFBIG:
        return f"{exc.strerror} (the daemon's file size limit, `ulimit -f`, is too low)"
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link (the daemon reads no links in its state folder)"
    return exc.strerror or str(exc)


def read_bytes(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Raises:
        StateFileError: missing (``missing`` is True), a link, not a regular file (a FIFO, a
            device, a folder), larger than ``max_bytes``, or unreadable.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise StateFileError(f"{path.name} does not exist", missing=True) from None
    except OSError as exc:
        raise StateFileError(f"cannot open {path.name}: {describe_os_error(exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(f"{path.name} is not a regular file")
        if info.st_size > max_bytes:
            raise StateFileError(
                f"{path.name} is {info.st_size} bytes, over the {max_bytes} bytes such a file "
                "may have"
            )
        chunks: list[bytes] = []
        left = max_bytes + 1  # one byte more tells a file that grew while being read
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise StateFileError(f"cannot read {path.name}: {describe_os_error(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise StateFileError(f"{path.name} is over the {max_bytes} bytes such a file may have")
    return data


def read_content_addressed(path: Path, sha256: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, checked against ``sha256`` (the hex digest they are stored under).

    Raises:
        StateFileError: as :func:`read_bytes`, or the bytes do not match the hash.
    """
    data = read_bytes(path, max_bytes)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise StateFileError(f"{path.name} is corrupt: its bytes do not match its hash")
    return data


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of the JSON ``text`` nest (strings are skipped).

    A linear scan, no recursion, so any input is measured in bounded stack.
    """
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def read_json(path: Path, max_bytes: int, max_depth: int) -> Any:
    """The JSON document in ``path``: at most ``max_bytes`` long, nested at most ``max_depth``.

    Raises:
        StateFileError: as :func:`read_bytes`, or not UTF-8, not JSON, or nested too deeply.
    """
    data = read_bytes(path, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise StateFileError(f"{path.name} is not UTF-8 text") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise StateFileError(
            f"{path.name} nests {depth} levels deep; the daemon's files nest at most {max_depth}"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        message = str(exc)[:200]
        raise StateFileError(f"{path.name} is not valid JSON: {message}") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(target: Path, data: bytes) -> None:
    """Replaces ``target`` with ``data``: written to a temporary file beside it, fsynced, renamed
    over it, the folder fsynced. A link at ``target`` is replaced, never followed.

    Raises:
        StateFileError: the write failed; no file is left behind and ``target`` is intact.
    """
    tmp = target.with_name(f"{target.name}{TMP_MARK}{secrets.token_hex(6)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StateFileError(f"could not write {target.name}: {describe_os_error(exc)}") from exc
