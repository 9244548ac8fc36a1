"""The module store: content addressing, atomic writes, integrity checks, one owner per folder."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evald.daemon._store import ModuleStore, StoreError

MODULE = b"\0asm\x01\0\0\0" + b"payload" * 100


def test_modules_are_content_addressed_and_stored_once(tmp_path: Path) -> None:
    store = ModuleStore(tmp_path)
    sha256, created = store.put_module(MODULE)
    assert sha256 == hashlib.sha256(MODULE).hexdigest()
    assert created
    assert (tmp_path / "modules" / f"{sha256}.wasm").read_bytes() == MODULE
    assert store.put_module(MODULE) == (sha256, False)
    assert store.read_module(sha256) == MODULE


def test_a_corrupted_module_is_detected(tmp_path: Path) -> None:
    store = ModuleStore(tmp_path)
    sha256, _ = store.put_module(MODULE)
    path = tmp_path / "modules" / f"{sha256}.wasm"
    path.write_bytes(MODULE[:-1] + b"X")
    with pytest.raises(StoreError, match="corrupt"):
        store.read_module(sha256)


def test_index_round_trips_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = ModuleStore(tmp_path)
    sha256, _ = store.put_module(MODULE)
    entries = {"mine": store.new_entry("mine", sha256)}
    store.write_index("team-a", entries)
    assert store.read_index("team-a") == entries
    assert store.read_index("nobody") == {}
    assert store.tenant_names() == ["team-a"]
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def test_a_malformed_index_is_a_typed_error(tmp_path: Path) -> None:
    store = ModuleStore(tmp_path)
    (tmp_path / "tenants" / "team-a.json").write_text('{"modules": {"x": {"sha256": "zz"}}}')
    with pytest.raises(StoreError, match="bad hash"):
        store.read_index("team-a")
    (tmp_path / "tenants" / "team-a.json").write_text("not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        store.read_index("team-a")


def test_garbage_collection_keeps_only_referenced_modules(tmp_path: Path) -> None:
    store = ModuleStore(tmp_path)
    kept, _ = store.put_module(MODULE)
    orphan, _ = store.put_module(MODULE + b"!")
    (tmp_path / "modules" / "x.wasm.tmp-123").write_bytes(b"torn")
    removed = store.collect_garbage({kept})
    assert sorted(removed) == sorted([f"{orphan}.wasm", "x.wasm.tmp-123"])
    assert sorted(p.name for p in (tmp_path / "modules").iterdir()) == [f"{kept}.wasm"]


def test_one_daemon_per_state_folder(tmp_path: Path) -> None:
    first = ModuleStore(tmp_path)
    first.lock()
    try:
        with pytest.raises(StoreError, match="another evald daemon is using"):
            ModuleStore(tmp_path).lock()
    finally:
        first.unlock()
    second = ModuleStore(tmp_path)
    second.lock()  # released by the first: free again
    second.unlock()


def test_a_failed_write_leaves_nothing_half_written(tmp_path: Path) -> None:
    """A real write failure: the kernel refuses to grow a file past RLIMIT_FSIZE (EFBIG)."""
    store = ModuleStore(tmp_path)
    sha256, _ = store.put_module(MODULE)
    store.write_index("team-a", {"small": store.new_entry("small", sha256)})
    index_before = (tmp_path / "tenants" / "team-a.json").read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, sys
        from pathlib import Path
        from evald.daemon._store import ModuleStore, StoreError
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        store = ModuleStore(Path({str(tmp_path)!r}))
        try:
            store.put_module(b"\\0asm" + b"x" * 100_000)
        except StoreError as exc:
            print(f"module: {{exc.code.value}}: {{exc.message}}")
        entries = store.read_index("team-a")
        for i in range(200):
            entries[f"name{{i}}"] = store.new_entry(f"name{{i}}", "0" * 64)
        try:
            store.write_index("team-a", entries)
        except StoreError as exc:
            print(f"index: {{exc.code.value}}: {{exc.message}}")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("module: unavailable: could not write")
    assert lines[1].startswith("index: unavailable: could not write team-a.json")
    assert "File too large" in result.stdout
    assert sorted(p.name for p in (tmp_path / "modules").iterdir()) == [f"{sha256}.wasm"]
    assert (tmp_path / "tenants" / "team-a.json").read_bytes() == index_before
    assert [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name] == []
