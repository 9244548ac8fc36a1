"""Durable storage of tenant-registered modules under the daemon's state folder.

Layout (everything below ``state_dir``)::

    lock                     held (flock) by the daemon that owns the folder
    modules/<sha256>.wasm    module bytes, content-addressed (tenants uploading the same share it)
    tenants/<tenant>.json    the tenant's index: evaluator name -> module hash
    cache/                   the host's compiled-module cache (default location)

Every write goes to a temporary file in the same folder, is fsynced, renamed over the target and
the folder fsynced, so a crash or a full disk leaves either the old file or the new one, never a
torn one. A module file is written before the index that names it; a crash between the two leaves
an unreferenced module, which :meth:`ModuleStore.collect_garbage` removes at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from evald.contract import ErrorCode, EvaldError

__all__ = ["IndexEntry", "ModuleStore", "StoreError"]

_INDEX_VERSION = 1
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TMP_MARK = ".tmp-"


class StoreError(EvaldError):
    """Storage failed (disk full, permissions, corruption); nothing was half-written."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


@dataclass(frozen=True)
class IndexEntry:
    """One registered evaluator of a tenant: its name, its module hash and when it was stored."""

    name: str
    sha256: str
    registered_at: str


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{exc.strerror} (free space in the daemon's state folder)"
    if exc.errno == errno.EFBIG:
        return f"{exc.strerror} (the daemon's file size limit, `ulimit -f`, is too low)"
    return exc.strerror or str(exc)


class ModuleStore:
    """The on-disk module store. Not thread-safe for writers: the registry serializes them."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.modules_dir = state_dir / "modules"
        self.tenants_dir = state_dir / "tenants"
        self._lock_file: IO[bytes] | None = None
        try:
            for folder in (state_dir, self.modules_dir, self.tenants_dir):
                folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            message = f"cannot create the state folder {state_dir}: {_describe(exc)}"
            raise StoreError(message) from exc

    def lock(self) -> None:
        """Takes the folder's exclusive lock so two daemons never share one store.

        Raises:
            StoreError: another process holds the lock.
        """
        handle = open(self.state_dir / "lock", "ab")  # held for the daemon's life
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise StoreError(
                f"another evald daemon is using the state folder {self.state_dir}; "
                "stop it or pass a different --state-dir"
            ) from None
        self._lock_file = handle

    def unlock(self) -> None:
        """Releases the folder's lock (also released by the kernel when the process dies)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # Writing ---------------------------------------------------------------------------------

    def _atomic_write(self, target: Path, data: bytes) -> None:
        tmp = target.with_name(f"{target.name}{_TMP_MARK}{secrets.token_hex(6)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
            raise StoreError(f"could not write {target.name}: {_describe(exc)}") from exc

    def put_module(self, wasm: bytes) -> tuple[str, bool]:
        """Stores module bytes under their hash.

        Returns:
            ``(sha256, created)``; ``created`` is False when the same bytes were already stored.

        Raises:
            StoreError: the write failed; no file is left behind.
        """
        sha256 = hashlib.sha256(wasm).hexdigest()
        target = self.modules_dir / f"{sha256}.wasm"
        existed = target.exists()
        # Written even when present: storing bytes another tenant stored first must take as
        # long as storing new bytes (no timing oracle); the rename over an identical file is
        # harmless.
        self._atomic_write(target, wasm)
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
        self._atomic_write(self.tenants_dir / f"{tenant}.json", data)

    @staticmethod
    def new_entry(name: str, sha256: str) -> IndexEntry:
        """An index entry stamped with the current UTC time."""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        return IndexEntry(name=name, sha256=sha256, registered_at=stamp)

    # Reading ---------------------------------------------------------------------------------

    def read_module(self, sha256: str) -> bytes:
        """The bytes of a stored module, checked against their hash.

        Raises:
            StoreError: missing, unreadable, or the bytes do not match the hash (corruption).
        """
        path = self.modules_dir / f"{sha256}.wasm"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StoreError(f"cannot read module {sha256[:12]}: {_describe(exc)}") from exc
        if hashlib.sha256(data).hexdigest() != sha256:
            raise StoreError(f"module {sha256[:12]} is corrupt: its bytes do not match its hash")
        return data

    def tenant_names(self) -> list[str]:
        """Tenants that have an index on disk (including ones no longer in the config)."""
        return sorted(
            path.stem for path in self.tenants_dir.glob("*.json") if _TMP_MARK not in path.name
        )

    def read_index(self, tenant: str) -> dict[str, IndexEntry]:
        """A tenant's index; empty when the tenant never registered anything.

        Raises:
            StoreError: the index exists but cannot be read or parsed.
        """
        path = self.tenants_dir / f"{tenant}.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            raise StoreError(f"cannot read the index of tenant {tenant!r}: {exc}") from exc
        try:
            document: Any = json.loads(text)
            modules = document["modules"]
            entries = {
                str(name): IndexEntry(
                    name=str(name),
                    sha256=str(info["sha256"]),
                    registered_at=str(info.get("registered_at", "")),
                )
                for name, info in modules.items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            message = f"the index of tenant {tenant!r} ({path}) is malformed: {exc}"
            raise StoreError(message) from exc
        for entry in entries.values():
            if not _SHA256_HEX.fullmatch(entry.sha256):
                message = f"the index of tenant {tenant!r} has a bad hash for {entry.name!r}"
                raise StoreError(message)
        return entries

    def collect_garbage(self, referenced: set[str]) -> list[str]:
        """Removes module files no index refers to and temporary files left by a crash.

        Returns:
            The names of the files removed.
        """
        removed: list[str] = []
        for folder in (self.modules_dir, self.tenants_dir):
            for path in folder.iterdir():
                stale_tmp = _TMP_MARK in path.name
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
