"""Registration leaves nothing behind, and shared files outlive any one tenant's view of them.

Against real daemons with their own state folders: refused registrations and register/delete
cycles leave no module or compiled-code files; stray compiled code is collected at start; a
module two tenants share survives one of them deleting it while the other's index is corrupt;
registration compiles every upload, whoever uploaded the same bytes before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_harness import Daemon, module, start_daemon, tenant_block

from evald.client import CallError
from evald.daemon import TenantConfig, TenantLimits
from evald.daemon._indexed_registry import IndexedRegistry
from evald.daemon._store import ModuleStore
from evald.host import CompiledModule, Limits, WasmHost, compile_module
from evald.testing import guest, manifest_bytes


def _config() -> str:
    return "\n".join(
        [
            "[server]",
            "threads = 2",
            "shutdown_grace_s = 2",
            tenant_block("alpha", evaluators=["calc"], allow_register=True, max_modules=4),
            tenant_block("beta", evaluators=["calc"], allow_register=True, max_modules=4),
            tenant_block("cramped", allow_register=True, max_modules=1),
        ]
    )


def _start(root: Path) -> Daemon:
    return start_daemon(root, _config(), state_dir=root / "state")


def _files(daemon: Daemon, folder: str, suffix: str) -> list[str]:
    return sorted(p.name for p in (daemon.state_dir / folder).glob(f"*{suffix}"))


def _cache_hashes(daemon: Daemon) -> set[str]:
    return {name.partition("-")[0] for name in _files(daemon, "cache", ".cwasm")}


def test_refusals_and_deletions_leave_no_files(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    try:
        baseline = _cache_hashes(daemon)  # the standard evaluators
        cramped = daemon.client("cramped")
        kept = module("echo", "keeper")
        cramped.register(kept)
        after_one = _cache_hashes(daemon)
        assert len(after_one - baseline) == 1
        for i in range(12):  # over max_modules: refused before anything is compiled
            with pytest.raises(CallError) as refused:
                cramped.register(module("echo", f"extra{i}"))
            assert refused.value.code == "invalid_argument"
        alpha = daemon.client("alpha")
        for i in range(12):  # a name that clashes with a standard one: refused as early
            with pytest.raises(CallError):
                alpha.register(module("echo", "calc" if i % 2 else "strop"))
        for i in range(8):  # register/delete cycles
            alpha.register(module("echo", f"cycle{i}"))
            alpha.delete(f"cycle{i}")
        assert _cache_hashes(daemon) == after_one
        assert len(_files(daemon, "modules", ".wasm")) == 1
    finally:
        assert daemon.stop() == 0


def test_stray_compiled_code_is_collected_at_start(tmp_path: Path) -> None:
    daemon = _start(tmp_path)
    daemon.client("alpha").register(module("echo", "kept"))
    baseline = _files(daemon, "cache", ".cwasm")
    assert daemon.stop() == 0
    cache = daemon.state_dir / "cache"
    stray = cache / f"{'ab' * 32}-0123456789abcdef.cwasm"
    stray.write_bytes(b"\0" * 64)
    (cache / ".tmp-crashed.cwasm").write_bytes(b"\0")
    daemon = _start(tmp_path)
    try:
        assert not stray.exists()
        assert not (cache / ".tmp-crashed.cwasm").exists()
        assert _files(daemon, "cache", ".cwasm") == baseline
        assert daemon.client("alpha").evaluate("kept", b"x").value == "x"
    finally:
        assert daemon.stop() == 0


def test_a_shared_module_survives_deletion_while_another_index_is_corrupt(
    tmp_path: Path,
) -> None:
    shared = module("echo", "shared")
    daemon = _start(tmp_path)
    daemon.client("alpha").register(shared)
    daemon.client("beta").register(shared)
    assert daemon.stop() == 0
    alpha_index = daemon.state_dir / "tenants" / "alpha.json"
    good = alpha_index.read_bytes()
    alpha_index.write_text("{ not json")
    daemon = _start(tmp_path)
    try:
        daemon.client("beta").delete("shared")
        assert len(_files(daemon, "modules", ".wasm")) == 1  # alpha's index may need it
        with pytest.raises(CallError) as refused:  # and alpha's index is not overwritten
            daemon.client("alpha").register(module("echo", "other"))
        assert refused.value.code == "unavailable"
        assert alpha_index.read_text() == "{ not json"
    finally:
        assert daemon.stop() == 0
    alpha_index.write_bytes(good)  # the operator repairs it
    daemon = _start(tmp_path)
    try:
        assert daemon.client("alpha").evaluate("shared", b"back").value == "back"
    finally:
        assert daemon.stop() == 0


def test_registration_compiles_bytes_another_tenant_uploaded(tmp_path: Path) -> None:
    """No shortcut on another tenant's upload: the compile step runs for every registration."""
    calls: list[str] = []
    host = WasmHost()
    store = ModuleStore(tmp_path / "state")

    def compile_upload(wasm: bytes, memory_cap: int) -> CompiledModule:
        calls.append("compile")
        return compile_module(host.config, wasm, memory_cap)

    limits = TenantLimits()
    tenants = [
        TenantConfig(name=name, token_sha256s=(), limits=limits, allow_register=True)
        for name in ("alpha", "beta")
    ]
    registry = IndexedRegistry(host, store, tenants, compile=compile_upload)
    wasm = module("echo", "same")
    registry.register(tenants[0], wasm, Limits(), False)
    registry.delete(tenants[0], "same")
    registry.register(tenants[1], wasm, Limits(), False)
    registry.register(tenants[0], wasm, Limits(), False)
    assert calls == ["compile"] * 3
    host.close()


def test_a_grammar_nested_deeper_than_the_contract_allows_is_refused_at_registration(
    tmp_path: Path,
) -> None:
    """The daemon accepted a grammar nested 1,500 deep that ``evald build`` refused; every
    lowering of it then failed with an untyped XGrammar error. Both apply one check now."""
    daemon = _start(tmp_path)
    try:
        deep = "root ::= " + "(" * 1_500 + '"a"' + ")" * 1_500
        wasm = guest("echo", manifest=manifest_bytes(name="deep", tag="deep", input_grammar=deep))
        with pytest.raises(CallError) as refused:
            daemon.client("alpha").register(wasm)
        assert refused.value.code is not None and refused.value.code.value == "invalid_module"
        assert "input_grammar nests groups 1500 deep" in str(refused.value)
        assert _files(daemon, "modules", ".wasm") == []
        # the daemon keeps serving
        assert daemon.client("alpha").evaluate("calc", b"6 * 7").value == "42"
    finally:
        assert daemon.stop() == 0
