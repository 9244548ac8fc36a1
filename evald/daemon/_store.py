"""Durable storage of tenant-registered modules under the daemon's state folder.

Layout (everything below ``state_dir``)::

    lock                     held (flock) by the daemon that owns the folder; holds its pid
    modules/<sha256>.wasm    module bytes, content-addressed (tenants uploading the same share it)
    tenants/<tenant>.json    the tenant's index: evaluator name -> module hash
    cache/                   the host's compiled-module cache (default location)

Every write is atomic (:func:`evald.daemon._state_files.atomic_write`), so a crash or a full disk
leaves either the old file or the new one, never a torn one. A module file is written before the
index that names it; a crash between the two leaves an unreferenced module, which
:meth:`ModuleStore.collect_garbage` removes at the next start.

Every read trusts nothing (:mod:`evald.daemon._state_files`): no link is followed, only a regular
file is read, a module is checked against its hash and bounded by the module size cap, an index
by :data:`MAX_INDEX_BYTES` and :data:`MAX_INDEX_DEPTH`, and an index must name the tenant whose
file it is (a copy of another tenant's index is refused, not served to the wrong tenant).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Final

from evald.daemon._state_files import (
    TMP_MARK,
    StateFileError,
    atomic_write,
    describe_os_error,
    read_content_addressed,
    read_json,
)

__all__ = [
    "MAX_INDEX_BYTES",
    "MAX_INDEX_DEPTH",
    "IndexEntry",
    "ModuleStore",
    "StoreError",
    "is_sha256",
    "parse_index",
    "running_daemon_pid",
]

_INDEX_VERSION = 1
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TENANT_FILE = re.compile(r"([a-z][a-z0-9_-]{0,63})\.json")
#: The largest tenant index read (about 6,000 entries; ``max_modules`` is 16 by default).
MAX_INDEX_BYTES: Final = 1024 * 1024
#: How deeply an index may nest (it nests 3 levels: document, modules, entry).
MAX_INDEX_DEPTH: Final = 8
#: The largest module file read when no module size cap is given.
_DEFAULT_MODULE_BYTES: Final = 64 * 1024 * 1024

#: Storage failed (disk full, permissions, corruption, a file that is not the daemon's);
#: nothing was half-written. ``unavailable``.
StoreError = StateFileError


def is_sha256(text: str) -> bool:
    """Whether ``text`` is a lower-case hex SHA-256."""
    return _SHA256_HEX.fullmatch(text) is not None


@dataclass(frozen=True)
class IndexEntry:
    """One registered evaluator of a tenant: its name, its module hash and when it was stored."""

    name: str
    sha256: str
    registered_at: str


def _real_folder(path: Path) -> None:
    """Creates ``path`` if missing; refuses a link or a file in its place."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        mode = path.lstat().st_mode
    except OSError as exc:
        raise StoreError(
            f"cannot create the state folder {path}: {describe_os_error(exc)}"
        ) from exc
    if not stat.S_ISDIR(mode):
        raise StoreError(
            f"{path} in the state folder is not a folder (a link or a file); the daemon uses "
            "only folders it made: move it away"
        )


class ModuleStore:
    """The on-disk module store. Not thread-safe for writers: the registry serializes them.

    ``max_module_bytes`` bounds a module file read back (the host's module size cap).
    """

    def __init__(self, state_dir: Path, *, max_module_bytes: int = _DEFAULT_MODULE_BYTES) -> None:
        self.state_dir = state_dir
        self.modules_dir = state_dir / "modules"
        self.tenants_dir = state_dir / "tenants"
        self.max_module_bytes = max_module_bytes
        self._lock_file: IO[bytes] | None = None
        for folder in (state_dir, self.modules_dir, self.tenants_dir):
            _real_folder(folder)

    def lock(self) -> None:
        """Takes the folder's exclusive lock so two daemons never share one store, and writes
        this process's pid into the lock file (``evald reload`` signals it).

        Raises:
            StoreError: another process holds the lock, or the lock file is not a plain file.
        """
        path = self.state_dir / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StoreError(
                f"cannot open the state folder's lock file {path}: {describe_os_error(exc)}"
            ) from None
        handle = os.fdopen(fd, "r+b")  # held for the daemon's life
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise StoreError(
                f"another evald daemon is using the state folder {self.state_dir}; "
                "stop it or pass a different --state-dir"
            ) from None
        with contextlib.suppress(OSError):
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n".encode())
            handle.flush()
        self._lock_file = handle

    def unlock(self) -> None:
        """Releases the folder's lock (also released by the kernel when the process dies)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # Writing ---------------------------------------------------------------------------------

    def put_module(self, wasm: bytes) -> tuple[str, bool]:
        """Stores module bytes under their hash.

        Returns:
            ``(sha256, created)``; ``created`` is False when the same bytes were already stored.

        Raises:
            StoreError: the write failed; no file is left behind.
        """
        sha256 = hashlib.sha256(wasm).hexdigest()
        target = self.modules_dir / f"{sha256}.wasm"
        existed = os.path.lexists(target)
        # Written even when present: storing bytes another tenant stored first must take as
        # long as storing new bytes (no timing oracle); the rename over an identical file is
        # harmless, and over anything else (a link, a damaged file) it repairs it.
        atomic_write(target, wasm)
        return sha256, not existed

    def remove_module(self, sha256: str) -> None:
        """Deletes a stored module file (used to undo a write whose index update failed)."""
        with contextlib.suppress(FileNotFoundError):
            (self.modules_dir / f"{sha256}.wasm").unlink()

    def write_index(self, tenant: str, entries: dict[str, IndexEntry]) -> None:
        """Replaces a tenant's index atomically.

        Raises:
            StoreError: the write failed; the previous index is intact.
        """
        document = {
            "version": _INDEX_VERSION,
            "tenant": tenant,
            "modules": {
                name: {"sha256": entry.sha256, "registered_at": entry.registered_at}
                for name, entry in sorted(entries.items())
            },
        }
        data = (json.dumps(document, indent=2) + "\n").encode("utf-8")
        atomic_write(self.tenants_dir / f"{tenant}.json", data)

    @staticmethod
    def new_entry(name: str, sha256: str) -> IndexEntry:
        """An index entry stamped with the current UTC time."""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        return IndexEntry(name=name, sha256=sha256, registered_at=stamp)

    # Reading ---------------------------------------------------------------------------------

    def module_path(self, sha256: str) -> Path:
        """Where the module with this hash is stored."""
        return self.modules_dir / f"{sha256}.wasm"

    def has_module(self, sha256: str) -> bool:
        """Whether a file is stored under this hash (not checked: :meth:`read_module` checks)."""
        return os.path.lexists(self.module_path(sha256))

    def read_module(self, sha256: str) -> bytes:
        """The bytes of a stored module, checked against their hash.

        Raises:
            StoreError: missing, a link, not a regular file, over the module size cap,
                unreadable, or the bytes do not match the hash (corruption).
        """
        if not is_sha256(sha256):
            raise StoreError(f"{sha256[:64]!r} is not a module hash")
        try:
            return read_content_addressed(self.module_path(sha256), sha256, self.max_module_bytes)
        except StateFileError as exc:
            raise StoreError(f"module {sha256[:12]}: {exc.message}") from None

    def tenant_names(self) -> list[str]:
        """Tenants that have an index on disk (including ones no longer in the config). Only
        names a tenant can have count; a link is listed (reading it is refused, and said)."""
        names: list[str] = []
        for path in self.tenants_dir.iterdir():
            match = _TENANT_FILE.fullmatch(path.name)
            if match is not None:
                names.append(match.group(1))
        return sorted(names)

    def read_index(self, tenant: str) -> dict[str, IndexEntry]:
        """A tenant's index; empty when the tenant never registered anything.

        Raises:
            StoreError: the index exists but cannot be read (a link, not a regular file, over
                :data:`MAX_INDEX_BYTES`, nested past :data:`MAX_INDEX_DEPTH`), or is malformed
                (not this tenant's, a bad hash).
        """
        path = self.tenants_dir / f"{tenant}.json"
        try:
            document: Any = read_json(path, MAX_INDEX_BYTES, MAX_INDEX_DEPTH)
        except StateFileError as exc:
            if exc.missing:
                return {}
            raise StoreError(f"the index of tenant {tenant!r} is refused: {exc.message}") from None
        return parse_index(tenant, document, f"the index of tenant {tenant!r} ({path})")

    def collect_garbage(self, referenced: set[str]) -> list[str]:
        """Removes module files no index refers to and temporary files left by a crash (a link
        is removed, never what it points to).

        Returns:
            The names of the files removed.
        """
        removed: list[str] = []
        for folder in (self.modules_dir, self.tenants_dir):
            for path in folder.iterdir():
                stale_tmp = TMP_MARK in path.name
                orphan = (
                    folder is self.modules_dir
                    and path.suffix == ".wasm"
                    and not stale_tmp
                    and path.stem not in referenced
                )
                if stale_tmp or orphan:
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed.append(path.name)
        return removed


def running_daemon_pid(state_dir: Path) -> int | None:
    """The pid of the daemon that holds ``state_dir``'s lock (None: no daemon holds it)."""
    path = state_dir / "lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            text = os.read(fd, 32).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)  # nobody held it
        return None
    finally:
        os.close(fd)


def parse_index(tenant: str, document: Any, where: str) -> dict[str, IndexEntry]:
    """The entries of one tenant's index document (the state folder's or the fleet cache's).

    Raises:
        StoreError: the document is not an index of ``tenant`` (``where`` names it).
    """
    try:
        if not isinstance(document, dict):
            raise TypeError("not a JSON object")
        owner = document.get("tenant", tenant)
        if owner != tenant:
            raise ValueError(
                f"it is the index of tenant {str(owner)[:64]!r}, not of {tenant!r} (copied "
                "or linked from another tenant's)"
            )
        modules = document["modules"]
        if not isinstance(modules, dict):
            raise TypeError("modules is not a JSON object")
        entries = {
            str(name): IndexEntry(
                name=str(name),
                sha256=str(info["sha256"]),
                registered_at=str(info.get("registered_at", "")),
            )
            for name, info in modules.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreError(f"{where} is malformed: {str(exc)[:200]}") from None
    for entry in entries.values():
        if not is_sha256(entry.sha256):
            raise StoreError(f"{where} has a bad hash for {entry.name[:64]!r}")
    return entries
