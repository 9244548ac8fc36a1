"""Compiled modules on disk, so a restart deserializes (≈0.1 ms) instead of compiling (≈20 ms).

A file is named ``<module sha256>-<engine fingerprint>.cwasm`` (the fingerprint covers the
wasmtime version, the engine settings and the host's rewrite of the module) and holds a
32-byte SHA-256 of the module's hash and the serialized module, followed by the serialized
module. The digest is checked before wasmtime sees the bytes: ``Module.deserialize`` trusts its
input (it is native code), so a truncated or damaged file must never reach it, and because the
digest covers the hash of the module the code was compiled from, another module's valid file
renamed into place fails it too (it would otherwise run under the wrong name). The file is
opened without following a link, must be a regular file (a FIFO never blocks the read) and at
most :data:`MAX_CACHED_BYTES` long. A file that fails a check or does not deserialize is
deleted and the module is compiled again. Writes go to a temporary file in the same directory
and are renamed into place, so readers see either nothing or a whole file.

The directory must be writable only by the daemon: anyone who can write a valid file there can
run native code in it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import wasmtime

__all__ = ["MAX_CACHED_BYTES", "ModuleCache"]

_log = logging.getLogger("evald.host")
_DIGEST_BYTES = 32
#: The largest compiled module read back (compiled code is a few times its module's size).
MAX_CACHED_BYTES: Final = 512 * 1024 * 1024


def _digest(sha256: str, payload: bytes) -> bytes:
    """What a cache file's first bytes hold: ties the compiled code to its module's hash."""
    return hashlib.sha256(sha256.encode("ascii") + b"\0" + payload).digest()


def _read_regular(path: Path) -> bytes | None:
    """The bytes of the regular file ``path`` (None when missing); never follows a link,
    never blocks on a FIFO, reads at most :data:`MAX_CACHED_BYTES`.

    Raises:
        OSError: a link, not a regular file, too large, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        if info.st_size > MAX_CACHED_BYTES:
            raise OSError(f"{path.name} is over {MAX_CACHED_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(MAX_CACHED_BYTES + 1)
    finally:
        os.close(fd)


class ModuleCache:
    """Compile-or-load for one engine; thread-safe (files are written atomically)."""

    def __init__(self, directory: Path | None, engine: wasmtime.Engine, fingerprint: str) -> None:
        self.directory = directory
        self._engine = engine
        self._fingerprint = fingerprint
        self.hits = 0
        self.misses = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path_for(self, sha256: str) -> Path | None:
        """Where the compiled form of the module with this hash lives (None: no disk cache)."""
        if self.directory is None:
            return None
        return self.directory / f"{sha256}-{self._fingerprint}.cwasm"

    def load(
        self, sha256: str, compile_module: Callable[[], wasmtime.Module]
    ) -> tuple[wasmtime.Module, bool]:
        """Returns (module, True) from the cache, or (compile_module(), False) and stores it."""
        path = self.path_for(sha256)
        if path is not None:
            module = self._read(path, sha256)
            if module is not None:
                self.hits += 1
                return module, True
        self.misses += 1
        module = compile_module()
        if path is not None:
            self._write(path, sha256, module)
        return module, False

    def store(self, sha256: str, module: wasmtime.Module) -> None:
        """Writes ``module`` as the compiled form of ``sha256`` (no-op without a directory)."""
        path = self.path_for(sha256)
        if path is not None:
            self._write(path, sha256, module)

    def remove(self, sha256: str) -> None:
        """Deletes the compiled form of ``sha256`` for every engine fingerprint."""
        if self.directory is None:
            return
        for path in self.directory.glob(f"{sha256}-*.cwasm"):
            path.unlink(missing_ok=True)

    def collect(self, keep: set[str]) -> list[str]:
        """Removes every cached file whose module hash is not in ``keep``, files of another
        engine fingerprint (an older wasmtime or other settings) and temporary files left by a
        crash. Returns the names removed."""
        if self.directory is None:
            return []
        removed: list[str] = []
        for path in self.directory.iterdir():
            sha256, _, rest = path.name.partition("-")
            current = rest == f"{self._fingerprint}.cwasm" and sha256 in keep
            if not current and (path.suffix == ".cwasm" or path.name.startswith(".tmp-")):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def _read(self, path: Path, sha256: str) -> wasmtime.Module | None:
        try:
            blob = _read_regular(path)
        except OSError as exc:
            _log.warning("compiled module %s refused (%s); recompiling", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        if blob is None:
            return None
        digest, payload = blob[:_DIGEST_BYTES], blob[_DIGEST_BYTES:]
        if len(digest) == _DIGEST_BYTES and _digest(sha256, payload) == digest:
            try:
                return wasmtime.Module.deserialize(self._engine, payload)
            except wasmtime.WasmtimeError as exc:
                _log.warning("compiled module %s does not load (%s); recompiling", path, exc)
        else:
            _log.warning(
                "compiled module %s is damaged or not this module's (checksum mismatch); "
                "recompiling",
                path,
            )
        path.unlink(missing_ok=True)
        return None

    def _write(self, path: Path, sha256: str, module: wasmtime.Module) -> None:
        try:
            payload = bytes(module.serialize())
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".cwasm", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(_digest(sha256, payload))
                    out.write(payload)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, wasmtime.WasmtimeError) as exc:
            # the cache is an optimisation: a full disk must not fail a registration
            _log.warning("cannot write compiled module %s: %s", path, exc)
