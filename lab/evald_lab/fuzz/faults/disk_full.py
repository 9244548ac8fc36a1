"""A full disk under the module store, on a second daemon of its own.

Its state folder is a real 1 MiB tmpfs (``mount -t tmpfs``, when the run may mount; otherwise the
daemon runs under ``ulimit -f``, a per-file size limit that makes the kernel refuse writes with
EFBIG: a stand-in for a full disk, reported as such). Registrations that do not fit — the module
write failing, and (tmpfs only) the module fitting but the tenant index not — must be refused
with ``unavailable`` and leave nothing behind: no temporary file, no orphan module, the index
unchanged, the daemon serving. After space returns, registration works and survives a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from evald.client import CallError, Client
from evald.daemon import hash_token
from evald.testing import DaemonProcess, guest, manifest_bytes, padded, start_daemon
from evald_lab.fuzz.checks import Violation, outcome_label

__all__ = ["disk_full"]

_DISK = "fault_disk_full"
_PAGE = 4096


def disk_full(root: Path, *, margin_ms: float) -> tuple[dict[str, Any], list[Violation]]:
    """The full-disk scenario on its own daemon under ``root``; returns (report, violations)."""
    del margin_ms
    return _DiskFull(root).run()


class _DiskFull:
    """One full-disk scenario: its daemon, its store, what each case came to."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = root / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.mounted = _mount_tmpfs(self.store, "1m")
        self.token = f"disk-{os.urandom(16).hex()}"
        self.config = _config(root, self.token)
        self.prefix: list[str] = (
            [] if self.mounted else ["bash", "-c", 'ulimit -f 512 && exec "$0" "$@"']
        )
        self.method = (
            "tmpfs size=1m (mount -t tmpfs)"
            if self.mounted
            else "fake: ulimit -f 512 (EFBIG per file)"
        )
        self.violations: list[Violation] = []
        self.outcomes: list[dict[str, Any]] = []

    def run(self) -> tuple[dict[str, Any], list[Violation]]:
        daemon: DaemonProcess | None = None
        filler: Path | None = None
        store = self.store
        try:
            daemon = self._start()
            client = Client(daemon.target, self.token, timeout_s=60)
            client.register(_module("disk_a"))
            self.outcomes.append({"case": "fits", "outcome": "registered"})
            if self.mounted:
                big = _module("disk_b", 300 * 1024)
                filler = _fill(store, 0)
                self._expect_refusal("module_write_fails", big, client)
                filler.unlink()
                # room for the module's pages but not for the new index
                filler = _fill(store, -(-len(big) // _PAGE) * _PAGE)
                self._expect_refusal("index_write_fails", big, client)
                filler.unlink()
                filler = None
            else:
                big = _module("disk_b", 600 * 1024)
                self._expect_refusal("module_write_fails", big, client)
                big = _module("disk_b", 100 * 1024)
            self._expect_serving(client, ["disk_a"])
            client.register(big)
            self.outcomes.append({"case": "space_back", "outcome": "registered"})
            client.close()
            daemon.stop(signal.SIGTERM)
            daemon = self._start()
            client = Client(daemon.target, self.token, timeout_s=60)
            names = sorted(info.name for info in client.list_evaluators() if info.owner == "tenant")
            if names != ["disk_a", "disk_b"]:
                self._fault(f"after restart the tenant has {names}")
            self._expect_serving(client, ["disk_a", "disk_b"])
            client.close()
        except (CallError, RuntimeError, OSError) as error:
            self._fault(f"the full-disk scenario failed: {error}")
        finally:
            if daemon is not None and daemon.alive():
                with contextlib.suppress(Exception):
                    daemon.stop(signal.SIGTERM, timeout_s=30)
            if filler is not None:
                filler.unlink(missing_ok=True)
            if self.mounted:
                subprocess.run(["umount", str(store)], capture_output=True, check=False)
        report = {"method": self.method, "cases": self.outcomes, "passed": not self.violations}
        return report, self.violations

    def _fault(self, message: str) -> None:
        self.violations.append(Violation("fault", _DISK, message))

    def _start(self) -> DaemonProcess:
        root = self.root
        return start_daemon(
            root, self.config, state_dir=self.store, socket_path=root / "d.sock", prefix=self.prefix
        )

    def _expect_refusal(self, label: str, wasm: bytes, client: Client) -> None:
        """Registering ``wasm`` must fail with ``unavailable``, leaving no file behind and the
        tenant's index as it was."""
        before_files = _store_files(self.store)
        before_index = _index(self.store, "tenant")
        try:
            client.register(wasm)
        except CallError as error:
            code = error.code.value if error.code is not None else "unreachable"
            self.outcomes.append({"case": label, "outcome": code, "message": error.message[:200]})
            if code != "unavailable":
                self._fault(f"{label}: refused with {code}, not unavailable: {error.message[:120]}")
        else:
            self.outcomes.append({"case": label, "outcome": "registered"})
            self._fault(f"{label}: registered although the store is full")
            return
        after_files = _store_files(self.store)
        leftovers = sorted(set(after_files) - set(before_files))
        if leftovers:
            self._fault(f"{label}: files left behind: {leftovers}")
        if _index(self.store, "tenant") != before_index:
            self._fault(f"{label}: the tenant index changed")

    def _expect_serving(self, client: Client, names: list[str]) -> None:
        for name in names:
            response = client.evaluate(name, b"still here")
            if outcome_label(response) != "ok" or response.value != "still here":
                self._fault(f"{name} does not answer after the full disk")


def _config(root: Path, token: str) -> str:
    """One worker, one tenant that may register: the daemon the disk fills under."""
    return "\n".join(
        [
            "[server]",
            "threads = 1",
            'log_level = "warning"',
            "shutdown_grace_s = 5",
            "[host]",
            f'cache_dir = "{root / "cache"}"',
            "[[tenants]]",
            'name = "tenant"',
            f'token_sha256 = "{hash_token(token)}"',
            "allow_register = true",
            "max_modules = 16",
        ]
    )


def _store_files(state: Path) -> dict[str, int]:
    files: dict[str, int] = {}
    for folder in ("modules", "tenants"):
        root = state / folder
        if root.is_dir():
            for path in root.iterdir():
                files[f"{folder}/{path.name}"] = path.stat().st_size
    return files


def _index(state: Path, tenant: str) -> dict[str, Any]:
    path = state / "tenants" / f"{tenant}.json"
    return json.loads(path.read_text())["modules"] if path.exists() else {}


def _fill(mount: Path, leave_bytes: int) -> Path:
    """Writes a filler file so that about ``leave_bytes`` stay free (page granularity)."""
    filler = mount / "filler"
    stats = os.statvfs(mount)
    free = stats.f_bavail * stats.f_frsize
    size = max(0, free - leave_bytes)
    with open(filler, "wb") as out:
        chunk = b"\0" * (1 << 16)
        remaining = size
        try:
            while remaining > 0:
                written = out.write(chunk[: min(len(chunk), remaining)])
                remaining -= written
            out.flush()
        except OSError:
            pass
    return filler


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def _module(name: str, total_bytes: int | None = None) -> bytes:
    wasm = guest(
        "echo", manifest=manifest_bytes(name=name, tag=name, semantics_version=f"{name}/1")
    )
    return padded(wasm, total_bytes) if total_bytes else wasm
