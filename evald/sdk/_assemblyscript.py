"""Builds an AssemblyScript evaluator (``assembly/index.ts``) with the ``asc`` compiler.

The guest package (``evald/sdk/guest/assemblyscript/evald-guest``, the ABI from the guest's
side) is found through ``--path``, so a project needs nothing of it installed. The settings
suit a guest:

* ``--runtime stub``: AssemblyScript's smallest runtime, a bump allocator that never frees or
  collects. An evaluation is one call whose value is copied out before it returns, so the guest
  package rewinds the heap at the start of every call: a call's memory is its peak, a reused
  instance behaves like a fresh one, and there is no collector to run or to pay for in code
  size. (``minimal`` would need someone to call its collector; ``incremental``, the default,
  adds a collector and a shadow stack a one-call guest never needs.)
* ``--use abort=``: a failed assertion or a ``throw`` is the ``unreachable`` trap instead of a
  call to an imported ``env.abort``, so the module imports nothing.
* ``-O3s``: optimised for speed, then size (fuel is charged per instruction executed).

The same sources and the same compiler version give the same bytes. Which ``asc``:
``$EVALD_ASC``, else the project's ``node_modules/.bin/asc`` (``npm install`` in the folder:
its package.json pins the compiler) or its parent folders' (as Node.js looks for packages), else
``asc`` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Final

from evald.contract import ErrorCode, EvaldError
from evald.sdk._compiler import BuildError, Compiler

__all__ = [
    "ASC_FLAGS",
    "ASC_VERSION",
    "ASSEMBLYSCRIPT_SOURCE",
    "GUEST_PACKAGES",
    "compile_assemblyscript",
    "find_asc",
]

#: The ``assemblyscript`` release the template pins and the committed port was built with.
ASC_VERSION: Final = "0.28.20"
#: The evaluator's entry file inside its folder.
ASSEMBLYSCRIPT_SOURCE: Final = "assembly/index.ts"
#: The folder holding the ``evald-guest`` package, passed to asc as a package path.
GUEST_PACKAGES: Final = Path(__file__).resolve().parent / "guest" / "assemblyscript"
ASC_FLAGS: Final = ("--runtime", "stub", "--use", "abort=", "-O3s", "--noColors")
_ENV_VARIABLE: Final = "EVALD_ASC"


def _version(asc: Path) -> str:
    """The version in the package.json of the ``assemblyscript`` package ``asc`` belongs to."""
    script = asc.resolve()  # node_modules/.bin/asc -> node_modules/assemblyscript/bin/asc.js
    for folder in script.parents:
        package = folder / "package.json"
        if package.is_file():
            try:
                data = json.loads(package.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                break
            if data.get("name") == "assemblyscript":
                return str(data.get("version", "unknown"))
            break
    return "unknown"


def find_asc(folder: Path) -> Compiler:
    """The ``asc`` ``evald build`` uses for the evaluator in ``folder`` (module docstring).

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` saying what was tried and what to install.
    """
    chosen = os.environ.get(_ENV_VARIABLE)
    if chosen:
        candidates = [chosen]
    else:  # as Node.js resolves packages: the folder's node_modules, then its parents'
        folder = folder.resolve()
        candidates = [str(up / "node_modules" / ".bin" / "asc") for up in (folder, *folder.parents)]
        candidates.append(shutil.which("asc") or "")
    for asc in filter(None, candidates):
        if Path(asc).is_file():
            return Compiler("asc", asc, _version(Path(asc)), ASC_VERSION)
    if shutil.which("node") is None:
        node = (
            "; asc runs on Node.js 20 or later, which is not installed either "
            "(`apt-get install nodejs npm` on Debian or Ubuntu)"
        )
    else:
        node = ""
    where = (
        f"${_ENV_VARIABLE}={chosen}"
        if chosen
        else f"node_modules/.bin/asc in {folder} and its parents, and asc on PATH"
    )
    raise EvaldError(
        ErrorCode.INVALID_ARGUMENT,
        f"the AssemblyScript compiler was not found (tried {where}); install it: `npm install` "
        f"in {folder} (its package.json pins assemblyscript {ASC_VERSION}), or `npm install "
        f"assemblyscript@{ASC_VERSION}` anywhere and set ${_ENV_VARIABLE} to its "
        f"node_modules/.bin/asc{node}",
    )


def compile_assemblyscript(folder: Path, toolchain: Compiler) -> bytes:
    """Compiles ``folder/assembly/index.ts`` to a module (no manifest yet).

    Raises:
        BuildError: asc refused the source (its diagnostics attached).
    """
    with tempfile.TemporaryDirectory(prefix="evald-asc-") as tmp:
        module = Path(tmp) / "module.wasm"
        command = [
            toolchain.path, ASSEMBLYSCRIPT_SOURCE, "--path", str(GUEST_PACKAGES), *ASC_FLAGS,
            "--outFile", str(module),
        ]  # fmt: skip
        try:
            proc = subprocess.run(command, capture_output=True, text=True, cwd=folder, timeout=600)
        except OSError as exc:
            raise EvaldError(
                ErrorCode.INVALID_ARGUMENT, f"cannot run {toolchain.path}: {exc.strerror}"
            ) from None
        if proc.returncode != 0 or not module.exists():
            raise BuildError(f"compiling {ASSEMBLYSCRIPT_SOURCE} failed", proc.stderr + proc.stdout)
        return module.read_bytes()
