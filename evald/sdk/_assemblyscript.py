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

The same sources and the same compiler version give the same bytes. Which ``asc``: the
operator's, never the folder's (a folder's ``node_modules/.bin/asc`` is a program the folder
chose; ``npm install`` in it runs the folder's install scripts): ``$EVALD_ASC``, else the pinned
compiler of a checkout of evald (``tools/assemblyscript``, :data:`CHECKOUT_ASC`), else ``asc`` on
PATH (an absolute entry outside the folder). Only ``--toolchain-from-folder`` looks in the
folder's ``node_modules`` and its parents' first (as Node.js resolves packages). Whichever it is,
it runs in the build's sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Final

from evald.contract import ErrorCode, EvaldError
from evald.sdk._compiler import BuildError, Compiler
from evald.sdk._sandbox import Scratch

__all__ = [
    "ASC_FLAGS",
    "ASC_VERSION",
    "ASSEMBLYSCRIPT_SOURCE",
    "CHECKOUT_ASC",
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


#: The pinned compiler of a checkout of evald (``make toolchains`` installs it there).
CHECKOUT_ASC: Final = (
    Path(__file__).resolve().parents[2]
    / "tools"
    / "assemblyscript"
    / "node_modules"
    / ".bin"
    / "asc"
)
_INSTALL: Final = (
    "install it outside any tenant's folder: `npm install --ignore-scripts --prefix "
    f"/opt/evald-asc assemblyscript@{ASC_VERSION}` and set ${_ENV_VARIABLE}="
    "/opt/evald-asc/node_modules/.bin/asc (in a checkout of evald, `make toolchains`)"
)


def _package(script: Path) -> Path | None:
    """The ``assemblyscript`` package folder ``script`` belongs to, if any."""
    for folder in script.parents:
        package = folder / "package.json"
        if package.is_file():
            try:
                data = json.loads(package.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
            return folder if data.get("name") == "assemblyscript" else None
    return None


def _version(asc: Path) -> str:
    """The version in the package.json of the ``assemblyscript`` package ``asc`` belongs to."""
    package = _package(asc.resolve())  # node_modules/.bin/asc -> .../assemblyscript/bin/asc.js
    if package is None:
        return "unknown"
    data = json.loads((package / "package.json").read_text(encoding="utf-8"))
    return str(data.get("version", "unknown"))


def _compiler(asc: str) -> Compiler:
    """``asc`` as the build starts it: Node.js on the package's script, with the folder of
    packages that holds ``assemblyscript`` (and its ``binaryen`` and ``long``) to read."""
    script = Path(asc).resolve()
    package = _package(script)
    if package is None:  # a wrapper of the operator's: run as it is, reading its own folder
        return Compiler("asc", asc, "unknown", ASC_VERSION, needs=(script.parent,))
    node = shutil.which("node")
    if node is None or not os.path.isabs(node):
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"{asc} runs on Node.js 20 or later, which is not installed (`apt-get install "
            "nodejs` on Debian or Ubuntu)",
        )
    node_binary = Path(node).resolve()
    return Compiler(
        "asc", asc, _version(script), ASC_VERSION, launcher=(str(node_binary), str(script)),
        needs=(package.parent, node_binary.parent.parent),
    )  # fmt: skip


def find_asc(folder: Path, *, from_folder: bool = False) -> Compiler:
    """The ``asc`` ``evald build`` uses for the evaluator in ``folder`` (module docstring):
    never one of the folder's unless ``from_folder`` (``--toolchain-from-folder``).

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` saying what was tried and what to install.
    """
    folder = folder.resolve()
    chosen = os.environ.get(_ENV_VARIABLE)
    on_path = shutil.which("asc") or ""
    if chosen:
        candidates = [chosen]
        where = f"${_ENV_VARIABLE}={chosen}"
    else:
        candidates = [str(CHECKOUT_ASC)]
        if os.path.isabs(on_path) and not Path(on_path).resolve().is_relative_to(folder):
            candidates.append(on_path)
        where = f"{CHECKOUT_ASC} and asc on PATH"
        if from_folder:  # as Node.js resolves packages: the folder's node_modules, then up
            ups = [str(up / "node_modules" / ".bin" / "asc") for up in (folder, *folder.parents)]
            candidates = ups + candidates
            where = f"node_modules/.bin/asc in {folder} and its parents, {where}"
    for asc in filter(None, candidates):
        if Path(asc).is_file():
            return _compiler(asc)
    if shutil.which("node") is None:
        node = (
            "; asc runs on Node.js 20 or later, which is not installed either "
            "(`apt-get install nodejs npm` on Debian or Ubuntu)"
        )
    else:
        node = ""
    raise EvaldError(
        ErrorCode.INVALID_ARGUMENT,
        f"the AssemblyScript compiler was not found (tried {where}); {_INSTALL}{node}",
    )


def compile_assemblyscript(folder: Path, toolchain: Compiler, scratch: Scratch) -> bytes:
    """Compiles ``folder/assembly/index.ts`` to a module (no manifest yet) in the build's
    sandbox. asc reads an empty configuration of the build's own instead of the folder's
    ``asconfig.json``, whose ``transform`` would load JavaScript from the folder.

    Raises:
        BuildError: asc refused the source (its diagnostics attached), or a limit stopped it.
    """
    module = scratch.out / "module.wasm"
    config = scratch.root / "asconfig.json"
    config.write_text("{}\n", encoding="utf-8")
    command = [
        *toolchain.argv, ASSEMBLYSCRIPT_SOURCE, "--path", str(GUEST_PACKAGES), *ASC_FLAGS,
        "--config", str(config), "--outFile", str(module),
    ]  # fmt: skip
    scratch.run(
        command, what=ASSEMBLYSCRIPT_SOURCE, cwd=folder, needs=(*toolchain.needs, GUEST_PACKAGES)
    )
    if not module.is_file():
        raise BuildError(f"compiling {ASSEMBLYSCRIPT_SOURCE} failed: asc wrote no module")
    return module.read_bytes()
