"""The compiled-module cache on disk: hits across hosts, keys, and damaged files."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from evald.host import HostConfig, Limits, WasmHost
from evald.testing import guest


def cache_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.cwasm"))


def load_and_run(directory: Path, wasm: bytes, **config: object) -> bool:
    """Loads ``wasm`` in a new host with the cache in ``directory``; returns from_cache."""
    with WasmHost(HostConfig(cache_dir=directory, **config)) as host:  # type: ignore[arg-type]
        module = host.load(wasm)
        assert host.evaluate(module, b"cached?", Limits()).value == "cached?"
        return module.from_cache


def test_a_second_host_loads_the_compiled_module_from_disk(tmp_path: Path) -> None:
    wasm = guest("echo")
    assert load_and_run(tmp_path, wasm) is False
    files = cache_files(tmp_path)
    assert len(files) == 1
    assert files[0].name.startswith(hashlib.sha256(wasm).hexdigest() + "-")
    assert load_and_run(tmp_path, wasm) is True
    assert not list(tmp_path.glob(".tmp-*"))  # writes were renamed into place


def test_the_key_covers_the_engine_settings(tmp_path: Path) -> None:
    wasm = guest("echo")
    assert load_and_run(tmp_path, wasm) is False
    assert load_and_run(tmp_path, wasm, max_wasm_stack_bytes=128 * 1024) is False
    assert len(cache_files(tmp_path)) == 2
    assert load_and_run(tmp_path, wasm, isolation="reuse") is False  # the default allocator
    assert len(cache_files(tmp_path)) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage_with_checksum"])
def test_a_damaged_file_is_ignored_and_rebuilt(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    wasm = guest("echo")
    load_and_run(tmp_path, wasm)
    (path,) = cache_files(tmp_path)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        del blob[len(blob) // 2 :]
    elif damage == "empty":
        blob.clear()
    else:  # a consistent checksum over bytes wasmtime does not accept
        payload = b"not a compiled module" * 10
        blob = bytearray(hashlib.sha256(payload).digest() + payload)
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="evald.host"):
        assert load_and_run(tmp_path, wasm) is False  # compiled again, and it runs
    assert "recompiling" in caplog.text
    assert load_and_run(tmp_path, wasm) is True  # the rebuilt file is good


def test_an_unwritable_cache_does_not_fail_a_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="evald.host"):
            load_and_run(directory, guest("echo"))
    finally:
        directory.chmod(0o700)
    if not cache_files(directory):  # (as root the directory stays writable)
        assert "cannot write compiled module" in caplog.text


def test_the_cache_directory_is_private(tmp_path: Path) -> None:
    directory = tmp_path / "new-cache"
    load_and_run(directory, guest("echo"))
    assert directory.stat().st_mode & 0o077 == 0
