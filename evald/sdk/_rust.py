"""Builds a Rust evaluator (``src/lib.rs``) with rustc for ``wasm32-unknown-unknown``.

``evald build`` drives rustc itself, not Cargo: two invocations, the SDK's guest crate
(``evald/sdk/guest/rust/evald-guest``, the ABI from the guest's side) as an rlib, then the
evaluator as a ``cdylib`` linked against it. So nothing is fetched from a registry, the build
needs only a rustc with the wasm32 standard library, and it is reproducible: the same sources
and the same rustc give the same bytes, wherever the folder and the SDK are (paths are remapped
out of panic locations).

The settings suit a guest: ``panic=abort`` (a panic is the ``unreachable`` trap, no unwinding
tables), ``opt-level=s`` with LTO and one codegen unit (small and fast), symbols stripped, a
64 KiB shadow stack like the Zig guests' (Rust's default is 1 MiB, placed first in memory so an
overflow traps instead of corrupting data), bulk memory instructions (a ``memcpy`` or zeroed
array is one ``memory.copy``/``memory.fill``, one unit of fuel, not a byte loop; wasmtime and
the daemon allow them), and the crate's arena as the allocator. The
``wasm32-unknown-unknown`` standard library imports nothing: what needs an operating system
(clock, files, threads) fails or panics inside the guest, and the module stays import-free.

Which rustc: ``$EVALD_RUSTC``, else the first of ``rustc`` on PATH and ``/usr/bin/rustc`` whose
sysroot holds the wasm32 standard library (a rustup toolchain without the target is skipped:
Debian's ``rustc`` with ``libstd-rust-dev-wasm32`` is what CI installs). A build runs the
compiler binary itself (``SYSROOT/bin/rustc``), never rustup's proxy, so a folder's
``rust-toolchain.toml`` cannot name a compiler of its own; inside the build's sandbox no
``RUSTUP_*``, ``CARGO_*`` or ``RUSTC_BOOTSTRAP`` variable is set.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Final

from evald.contract import ErrorCode, EvaldError
from evald.sdk._compiler import BuildError, Compiler
from evald.sdk._sandbox import Scratch

__all__ = [
    "GUEST_CRATE",
    "RUST_FLAGS",
    "RUST_SOURCE",
    "RUST_TARGET",
    "RUST_VERSION",
    "compile_rust",
    "find_rustc",
    "refuse_dependencies",
]

#: The rustc release the committed Rust port was built with (Debian 12's ``rustc``); another
#: one builds too, with a warning that the bytes may differ.
RUST_VERSION: Final = "1.63.0"
RUST_TARGET: Final = "wasm32-unknown-unknown"
#: The evaluator's crate root inside its folder.
RUST_SOURCE: Final = "src/lib.rs"
#: The guest crate (its ``src/lib.rs``), shipped inside the SDK.
GUEST_CRATE: Final = Path(__file__).resolve().parent / "guest" / "rust" / "evald-guest"
#: What both invocations pass (the evaluator adds LTO, stripping and the stack size).
RUST_FLAGS: Final = (
    "--edition", "2021", "--target", RUST_TARGET, "--color", "never",
    "-C", "opt-level=s", "-C", "panic=abort", "-C", "codegen-units=1", "-C", "debuginfo=0",
    "-C", "target-feature=+bulk-memory",
)  # fmt: skip
_ENV_VARIABLE: Final = "EVALD_RUSTC"
_SYSTEM_RUSTC: Final = "/usr/bin/rustc"
_INSTALL: Final = (
    "on Debian or Ubuntu `apt-get install --no-install-recommends rustc "
    "libstd-rust-dev-wasm32 lld-14` (evald then finds /usr/bin/rustc); with rustup `rustup "
    f"target add {RUST_TARGET}`; or set ${_ENV_VARIABLE} to a rustc that has the target"
)


def _missing(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_ARGUMENT, message)


@functools.cache
def _probe(rustc: str) -> tuple[str, bool, Path] | str:
    """``(version, has the wasm32 standard library, the compiler binary itself)`` of one
    rustc, or why it cannot run. Asked from ``/``, so that a rustup proxy answers for the
    operator's toolchain and no folder's ``rust-toolchain.toml`` applies; the binary is
    ``SYSROOT/bin/rustc``, which a build then runs directly, never through the proxy."""

    def ask(binary: str, *question: str) -> str:
        return subprocess.run(
            [binary, *question], capture_output=True, text=True, timeout=60, check=True, cwd="/"
        ).stdout.strip()

    try:
        sysroot = Path(ask(rustc, "--print", "sysroot"))
        binary = sysroot / "bin" / "rustc"
        real = str(binary) if binary.is_file() else rustc
        version = ask(real, "--version").split()[1]
        libdir = ask(real, "--print", "target-libdir", "--target", RUST_TARGET)
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return f"does not run ({exc})"
    return version, any(Path(libdir).glob("libstd-*.rlib")), Path(real)


def find_rustc() -> Compiler:
    """The rustc ``evald build`` uses for Rust (module docstring says which): the compiler
    binary itself, with its sysroot as what the build's sandbox shows it.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` saying what was tried and what to install.
    """
    chosen = os.environ.get(_ENV_VARIABLE)
    on_path = shutil.which("rustc")
    candidates = [chosen] if chosen else [on_path if on_path and os.path.isabs(on_path) else None,
                                          _SYSTEM_RUSTC]  # fmt: skip
    tried = []
    for rustc in dict.fromkeys(c for c in candidates if c):
        if not Path(rustc).exists():
            tried.append(f"{rustc} (not installed)")
            continue
        probe = _probe(os.path.abspath(rustc))  # asked from /: a relative name must not move
        if isinstance(probe, str):
            tried.append(f"{rustc} ({probe})")
        elif not probe[1]:
            tried.append(f"{rustc} (rustc {probe[0]}, no {RUST_TARGET} standard library)")
        else:
            binary = probe[2].resolve()
            sysroot = binary.parent.parent
            return Compiler("rustc", str(probe[2]), probe[0], RUST_VERSION, needs=(sysroot,))
    where = f"${_ENV_VARIABLE}={chosen}" if chosen else "rustc on PATH and /usr/bin/rustc"
    raise _missing(
        f"no Rust compiler for {RUST_TARGET} was found (tried {where}: "
        f"{'; '.join(tried) or 'none on PATH'}); install one: {_INSTALL}"
    )


def _dependencies(folder: Path) -> list[str]:
    cargo = folder / "Cargo.toml"
    if not cargo.is_file():
        return []
    try:
        manifest = tomllib.loads(cargo.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _missing(f"{cargo} is not valid TOML: {exc}") from None
    return sorted(set(manifest.get("dependencies", {})) - {"evald-guest"})


def refuse_dependencies(folder: Path) -> None:
    """Refuses a project whose ``Cargo.toml`` names a dependency other than evald-guest,
    before any compiler is looked for: the answer does not depend on one.

    Raises:
        EvaldError: ``INVALID_ARGUMENT``, naming the dependencies and what to do instead.
    """
    extra = _dependencies(folder)
    if extra:
        raise _missing(
            f"{folder / 'Cargo.toml'} depends on {', '.join(extra)}; `evald build` links only "
            "the evald-guest crate and Rust's standard library (no registry, reproducible "
            "builds): move the code you need into src/"
        )


def compile_rust(folder: Path, toolchain: Compiler, scratch: Scratch) -> bytes:
    """Compiles ``folder/src/lib.rs`` and the guest crate to a module (no manifest yet), each
    in the build's sandbox.

    Raises:
        BuildError: rustc refused the source (its diagnostics attached), or a limit stopped it.
        EvaldError: ``INVALID_ARGUMENT`` for a dependency other than evald-guest, or a rustc
            that cannot link for wasm32.
    """
    refuse_dependencies(folder)
    out = scratch.out
    guest = [
        *toolchain.argv, *RUST_FLAGS, "--crate-type", "rlib", "--crate-name", "evald_guest",
        "--remap-path-prefix", f"{GUEST_CRATE}=evald-guest", "--out-dir", str(out),
        str(GUEST_CRATE / "src" / "lib.rs"),
    ]  # fmt: skip
    _run(guest, GUEST_CRATE, "the evald-guest crate", toolchain, scratch)
    module = out / "module.wasm"
    evaluator = [
        *toolchain.argv, *RUST_FLAGS, "-C", "lto", "-C", "strip=symbols",
        "-C", "link-arg=-zstack-size=65536", "--crate-type", "cdylib",
        "--crate-name", "evaluator", "--extern", f"evald_guest={out / 'libevald_guest.rlib'}",
        "--remap-path-prefix", f"{folder}=.", "-o", str(module), RUST_SOURCE,
    ]  # fmt: skip
    _run(evaluator, folder, RUST_SOURCE, toolchain, scratch)
    if not module.is_file():
        raise BuildError(f"compiling {RUST_SOURCE} failed: rustc wrote no module")
    return module.read_bytes()


def _run(command: list[str], cwd: Path, what: str, toolchain: Compiler, scratch: Scratch) -> None:
    try:
        scratch.run(command, what=what, cwd=cwd, needs=(*toolchain.needs, GUEST_CRATE))
    except BuildError as exc:
        if "linker `rust-lld` not found" in exc.output:
            raise _missing(
                f"{toolchain.path} cannot link for {RUST_TARGET}: its linker rust-lld is "
                "missing (on Debian or Ubuntu `apt-get install lld-14`: the rustc package "
                "links /usr/bin/rust-lld to it)"
            ) from None
        raise
