"""A tenant's folder is code that runs at build time: ``evald build`` runs it in a sandbox.

Each test is one way a folder reached the builder's machine before the sandbox (issue 45),
built with the real compilers and the real bwrap: a folder's own ``asc`` never runs (and one
the operator allows runs inside the sandbox, without the network or the builder's files), C's
``#embed`` and Rust's ``include_bytes!`` find nothing of the builder's, a ``rust-toolchain.toml``
names no compiler, a manifest link out of the folder is refused, a Zig ``comptime`` loop ends at
the build's wall clock with nothing left running, and a builder without bwrap is refused unless
the operator says ``--unsandboxed``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sdk_cli import Run, cli
from toolchains import require_toolchain

import evald.sdk as sdk
from evald.sdk._compiler import BuildError
from evald.sdk._rust import _probe
from evald.sdk._sandbox import Scratch

#: The message of a build refused for want of bwrap starts so.
NO_BWRAP = (
    "error: invalid_argument: evald build runs a folder's compilers in a sandbox, and bwrap "
    "(bubblewrap) is not installed: install bubblewrap (`apt-get install bubblewrap`"
)


@pytest.fixture(autouse=True)
def _bwrap_here() -> None:
    if shutil.which("bwrap") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs bubblewrap (.ci/run), but bwrap is not on PATH")
        pytest.skip("bwrap is not installed (apt-get install bubblewrap)")


def _new(tmp_path: Path, language: str, name: str = "probe") -> Path:
    folder = tmp_path / "tenant" / name
    made = cli("new", name, "--lang", language, "--dir", folder)
    assert made.status == 0, made.err
    return folder


def _processes_naming(text: str) -> list[str]:
    """Command lines of the machine's processes that mention ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in line:
            found.append(line)
    return found


# --- the folder's own compiler ------------------------------------------------------------


def test_a_folders_own_asc_never_runs_and_the_pinned_one_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that ships ``node_modules/.bin/asc`` (a script writing outside the folder) is
    built with the operator's pinned asc; the script never runs, even with no $EVALD_ASC."""
    require_toolchain("assemblyscript")
    monkeypatch.delenv("EVALD_ASC", raising=False)
    folder = _new(tmp_path, "assemblyscript")
    marker = tmp_path / "marker"
    fake = folder / "node_modules" / ".bin" / "asc"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!/bin/sh\necho ran > {marker}\nexit 1\n")
    fake.chmod(0o755)
    run = cli("build", folder, "--no-grammar-check")
    assert not marker.exists()
    assert run.status == 0, run.err
    assert f"asc {sdk.ASC_VERSION} ({sdk.CHECKOUT_ASC})" in run.out, run.out
    # Asked for explicitly, the folder's compiler runs, but in the sandbox: no way out.
    run = cli("build", folder, "--no-grammar-check", "--toolchain-from-folder")
    assert run.status == 2
    assert f"cannot create {marker}: Read-only file system" in run.err, run.err
    assert not marker.exists()


def test_a_missing_asc_is_never_an_npm_install_in_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _new(tmp_path, "assemblyscript")
    monkeypatch.setenv("EVALD_ASC", str(tmp_path / "no-asc"))
    run = cli("build", folder, "--no-grammar-check")
    assert run.status == 2
    assert "install it outside any tenant's folder: `npm install --ignore-scripts --prefix" in (
        run.err
    )
    assert f"in {folder}" not in run.err and "`npm install` in" not in run.err


class _Listener:
    """A TCP server on every address of the builder, counting the connections it accepts."""

    def __init__(self) -> None:
        self.server = socket.create_server(("0.0.0.0", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = 0
        self.server.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


@pytest.fixture
def listener() -> Iterator[_Listener]:
    handle = _Listener()
    try:
        yield handle
    finally:
        handle.close()


def _builder_addresses() -> list[str]:
    """127.0.0.1 and the builder's address towards the outside, where it has one."""
    addresses = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a route lookup, no packet sent
            addresses.append(probe.getsockname()[0])
        except OSError:
            pass
    return addresses


def test_the_network_is_unreachable_from_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listener: _Listener
) -> None:
    """Compile-time code (a folder's asc, allowed with --toolchain-from-folder) connects to
    a server of the builder's on each of its addresses: it reaches it unsandboxed, and not
    at all from the sandbox."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    monkeypatch.delenv("EVALD_ASC", raising=False)
    folder = _new(tmp_path, "assemblyscript")
    script = folder / "node_modules" / ".bin" / "asc"
    script.parent.mkdir(parents=True)
    addresses = _builder_addresses()
    script.write_text(
        "#!/usr/bin/env node\n"
        "const net = require('net');\n"
        f"const addresses = {json.dumps(addresses)};\n"
        "let left = addresses.length;\n"
        "for (const host of addresses) {\n"
        f"  const s = net.connect({{host, port: {listener.port}, timeout: 5000}});\n"
        "  const done = (what) => { console.log(`${host}: ${what}`); s.destroy();\n"
        "                           if (--left === 0) process.exit(1); };\n"
        "  s.on('connect', () => done('connected'));\n"
        "  s.on('timeout', () => done('timeout'));\n"
        "  s.on('error', (e) => done(e.code));\n"
        "}\n"
    )
    script.chmod(0o755)
    unsandboxed = cli(
        "build", folder, "--no-grammar-check", "--toolchain-from-folder", "--unsandboxed"
    )
    assert "127.0.0.1: connected" in unsandboxed.err, unsandboxed.err
    reached = listener.accepted
    assert reached >= 1
    run = cli("build", folder, "--no-grammar-check", "--toolchain-from-folder")
    assert run.status == 2
    for host in addresses:
        assert f"{host}: " in run.err and f"{host}: connected" not in run.err, run.err
    assert "127.0.0.1: ECONNREFUSED" in run.err, run.err
    assert listener.accepted == reached


# --- the builder's files ------------------------------------------------------------------

EMBED_C = """
static const unsigned char leaked[] = {
#embed "EMBEDDED"
};
EXPORT("leak") int leak(void) { return (int)(long)leaked; }
"""


def test_c_embed_of_a_file_the_builder_can_read_finds_nothing(tmp_path: Path) -> None:
    """``#embed`` of a file outside the folder that the builder can read (by absolute and by
    relative path, and ``/etc/shadow``) fails to build: the sandbox holds no such file."""
    folder = _new(tmp_path, "c")
    secret = secrets.token_hex(16)
    (tmp_path / "secret.txt").write_text(secret)
    source = folder / "main.c"
    template = source.read_text()
    for embedded in (str(tmp_path / "secret.txt"), "../../secret.txt", "/etc/shadow"):
        source.write_text(template + EMBED_C.replace("EMBEDDED", embedded))
        run = cli("build", folder, "--no-grammar-check")
        assert run.status == 2, run.out
        assert f"fatal error: '{embedded}' file not found" in run.err, run.err
        assert secret not in run.out + run.err
        assert not list(folder.glob("*.wasm"))


RUST_LEAK = """
use evald_guest::{evaluator, Result};

evaluator!(leak, input_capacity = 64, output_capacity = 4096);

static LEAKED: &[u8] = include_bytes!("ENVIRON");

fn leak(_input: &str) -> Result<String> {
    Ok(String::from_utf8_lossy(LEAKED).into_owned())
}
"""


def test_rust_include_bytes_of_the_environment_finds_only_the_clean_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The builder's environment holds a secret; ``include_bytes!`` of the compiler's own
    ``environ``, then of the sandbox's first process's (bwrap's), copies only the build's
    variables."""
    require_toolchain("rust")
    secret = secrets.token_hex(16)
    monkeypatch.setenv("EVALD_TEST_SECRET", secret)
    folder = _new(tmp_path, "rust")
    for environ in ("/proc/self/environ", "/proc/1/environ"):
        (folder / "src" / "lib.rs").write_text(RUST_LEAK.replace("ENVIRON", environ))
        wasm = sdk.compile_folder(folder).wasm
        assert secret.encode() not in wasm, environ
        assert b"PATH=/usr/bin:/bin\0" in wasm, environ  # the file was read: the clean one
        assert f"HOME={Path.home()}\0".encode() not in wasm, environ


def test_a_rust_toolchain_file_names_no_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from inside the folder (``evald build .``) with rustup's proxy first on PATH, a
    ``rust-toolchain.toml`` naming a toolchain of the folder's (a script writing outside) is
    ignored: the proxy is asked from ``/`` and the build runs the compiler binary itself."""
    require_toolchain("rust")
    proxy = shutil.which("rustc")
    if proxy is None or not (Path(proxy).parent / "rustup").exists():
        pytest.skip("rustc on PATH is not rustup's proxy: nothing here reads rust-toolchain.toml")
    monkeypatch.delenv("EVALD_RUSTC", raising=False)
    monkeypatch.delenv("RUSTUP_TOOLCHAIN", raising=False)
    _probe.cache_clear()  # each rustc is asked once per process: ask again, from here
    folder = _new(tmp_path, "rust")
    marker = tmp_path / "marker"
    rustc = folder / "toolchain" / "bin" / "rustc"
    rustc.parent.mkdir(parents=True)
    rustc.write_text(f"#!/bin/sh\necho ran >> {marker}\necho 'rustc 9.9.9 (the folder)'\n")
    rustc.chmod(0o755)
    (folder / "rust-toolchain.toml").write_text(f'[toolchain]\npath = "{folder / "toolchain"}"\n')
    monkeypatch.chdir(folder)
    run = cli("build", ".", "--no-grammar-check")
    assert not marker.exists()
    assert run.status == 0, run.err
    assert "rustc 9.9.9" not in run.out and "rustc " in run.out


def test_a_manifest_file_leading_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    """The grammar is text the daemon hands to every caller: a link to a file of the
    builder's would publish it."""
    folder = _new(tmp_path, "zig")
    secret = secrets.token_hex(16)
    (tmp_path / "secret.txt").write_text(f'root ::= "{secret}"\n')
    (folder / "grammar.ebnf").unlink()
    (folder / "grammar.ebnf").symlink_to(tmp_path / "secret.txt")
    run = cli("build", folder, "--no-grammar-check")
    assert run.status == 2
    assert run.err == (
        f"error: invalid_argument: {folder / 'grammar.ebnf'} leads to {tmp_path / 'secret.txt'}, "
        "outside the evaluator folder; a build reads only the folder's own files (copy the "
        "file into the folder)\n"
    )
    assert not list(folder.glob("*.wasm"))


def test_a_manifest_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """A FIFO as grammar.ebnf would hold the builder (who reads the manifest outside the
    sandbox) until someone writes to it; here a writer does, so without the rule the build
    would go on with what it wrote."""
    folder = _new(tmp_path, "zig")
    fifo = folder / "grammar.ebnf"
    fifo.unlink()
    os.mkfifo(fifo)
    done = threading.Event()

    def feed() -> None:  # a grammar to every reader, until the test is over
        while not done.is_set():
            with contextlib.suppress(OSError), open(fifo, "w") as writer:
                writer.write('root ::= "fed"\n')

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        run = cli("build", folder, "--no-grammar-check")
    finally:
        done.set()
        with contextlib.suppress(OSError):  # let the writer go
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        feeder.join(timeout=60)
    assert (run.status, run.err) == (
        2,
        f"error: invalid_argument: {fifo} is not a regular file; a build reads only regular "
        "files\n",
    )


# --- limits -------------------------------------------------------------------------------

COMPTIME_LOOP = """
comptime {
    @setEvalBranchQuota(0xffffffff);
    var i: u64 = 0;
    while (true) : (i +%= 1) {}
}
"""


def test_a_comptime_loop_ends_at_the_builds_wall_clock_with_nothing_left(
    tmp_path: Path,
) -> None:
    folder = _new(tmp_path, "zig", "forever")
    source = folder / "main.zig"
    source.write_text(source.read_text() + COMPTIME_LOOP)
    run = cli("build", folder, "--no-grammar-check", "--timeout", "5")
    assert run.status == 2
    assert (
        "error: invalid_module: compiling main.zig did not finish within the build's "
        "wall-clock limit of 5 s (--timeout); every process of the build was killed"
    ) in run.err, run.err
    assert _processes_naming(str(source)) == []
    assert not list(folder.glob("*.wasm"))


def test_a_comptime_loop_ends_at_the_cpu_limit(tmp_path: Path) -> None:
    folder = _new(tmp_path, "zig", "forever")
    source = folder / "main.zig"
    source.write_text(source.read_text() + COMPTIME_LOOP)
    run = cli("build", folder, "--no-grammar-check", "--cpu-seconds", "2", "--timeout", "300")
    assert run.status == 2
    # SIGXCPU at 2 CPU seconds ends it, or now and then (Zig's threads busy) SIGKILL at 3
    at_soft_limit = (
        "error: invalid_module: compiling main.zig was stopped: a compiler process used the "
        "build's 2 CPU seconds (--cpu-seconds)\n"
    )
    at_hard_limit = (
        "error: invalid_module: compiling main.zig failed: the compiler was killed by SIGKILL "
        "(the build's limits: 300 s wall clock for the build (--timeout), 2 CPU seconds "
        "(--cpu-seconds) and"
    )
    assert run.err.endswith(at_soft_limit) or at_hard_limit in run.err, run.err
    assert _processes_naming(str(source)) == []


#: A compiler that ignores ``SIGXCPU`` and loops: the kernel kills it at the hard CPU limit,
#: with ``SIGKILL``, a CPU second past the one the build set.
IGNORES_SIGXCPU = ["/bin/sh", "-c", "trap '' XCPU; while :; do :; done"]


def test_a_compiler_killed_at_the_hard_cpu_limit_is_told_as_the_cpu_limit(
    tmp_path: Path,
) -> None:
    """``SIGXCPU`` at the limit, ``SIGKILL`` a CPU second later: an unsandboxed run the second
    ends still names ``--cpu-seconds``, read from the CPU the kernel says the run used. In
    bwrap the sandbox does not hand its compiler's CPU time on: there the message names the
    signal and lists every limit (the next test's, and Zig's comptime loop's when its threads
    keep it from acting on ``SIGXCPU`` in time)."""
    sandbox = sdk.BuildSandbox(limits=sdk.BuildLimits(cpu_s=1), unsandboxed=True)
    with Scratch(sandbox, tmp_path) as scratch, pytest.raises(BuildError) as raised:
        scratch.run(IGNORES_SIGXCPU, what="loop.zig", cwd=tmp_path)
    assert str(raised.value) == (
        "compiling loop.zig was stopped: a compiler process used the build's 1 CPU seconds "
        "(--cpu-seconds)"
    )


def test_a_compiler_killed_before_the_cpu_limit_is_told_by_its_signal(tmp_path: Path) -> None:
    """A ``SIGKILL`` that is not the CPU limit's (here the compiler's own, at once) says the
    signal and every limit, and no CPU limit it did not reach."""
    sandbox = sdk.BuildSandbox(limits=sdk.BuildLimits(cpu_s=5))
    with Scratch(sandbox, tmp_path) as scratch, pytest.raises(BuildError) as raised:
        scratch.run(["/bin/sh", "-c", "kill -KILL $$"], what="main.zig", cwd=tmp_path)
    assert str(raised.value).startswith(
        "compiling main.zig failed: the compiler was killed by SIGKILL (the build's limits: "
    ), str(raised.value)


def test_a_compiler_past_the_memory_limit_fails_naming_it(tmp_path: Path) -> None:
    """Zig needs more than 32 MiB for the template: under --memory-mib 32 its allocations
    fail, and the message says which limit."""
    folder = _new(tmp_path, "zig")
    run = cli("build", folder, "--no-grammar-check", "--memory-mib", "32")
    assert run.status == 2
    assert run.err.endswith(
        "error: invalid_module: compiling main.zig failed: the compiler ran out of memory or "
        "another resource (the build's memory limit is 32 MiB per process: --memory-mib) "
        "(compiler output above)\n"
    ), run.err


def test_limits_must_be_positive(tmp_path: Path) -> None:
    run = cli("build", tmp_path, "--timeout", "0")
    assert (run.status, run.err) == (
        2,
        "error: invalid_argument: --build-timeout, --cpu-seconds and --memory-mib must be "
        "positive\n",
    )


# --- without bwrap ------------------------------------------------------------------------


def _build_without_bwrap(folder: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> Run:
    """A PATH without bwrap (the Zig compiler is found by its package, not on PATH)."""
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(folder.parent))
        return cli("build", folder, "--no-grammar-check", *flags)


def test_without_bwrap_a_build_is_refused_unless_unsandboxed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _new(tmp_path, "zig")
    run = _build_without_bwrap(folder, monkeypatch)
    assert run.status == 2 and run.err.startswith(NO_BWRAP), run.err
    assert "or pass --unsandboxed to build without it (dangerous" in run.err
    assert not list(folder.glob("*.wasm"))
    run = _build_without_bwrap(folder, monkeypatch, "--unsandboxed")
    assert run.status == 0, run.err
    assert run.err.startswith("warning: --unsandboxed: the folder's compilers run with your")
    sandboxed = cli("build", folder, "--no-grammar-check", "-o", tmp_path / "sandboxed.wasm")
    assert sandboxed.status == 0, sandboxed.err
    assert (tmp_path / "sandboxed.wasm").read_bytes() == (folder / "probe.wasm").read_bytes()
