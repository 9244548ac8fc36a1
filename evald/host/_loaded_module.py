"""A module the host has accepted: validated, compiled and trial-instantiated once.

"Compile once, instantiate many": loading (:mod:`evald.host._module_loader`) does the expensive
and the risky work a single time and records what every later instance needs — the compiled
code, which export to call, and where the guest's buffers lie — so a new instance
(:mod:`evald.host._instance`) is cheap and calls no guest function but ``evald_eval``.
"""

from __future__ import annotations

import wasmtime

from evald.contract import EVAL_EXPORT, Manifest
from evald.host._instrument import EVAL_WRAPPER_EXPORT, FRESH_WRAPPER_EXPORT, GROW_FLAG_EXPORT

__all__ = ["LoadedModule"]


class LoadedModule:
    """A validated, compiled module; cheap to instantiate, shared by all threads.

    Attributes:
        manifest: the module's manifest.
        sha256: hex SHA-256 of the module bytes as uploaded (its identity).
        size_bytes: size of the module as uploaded.
        input_cap, output_cap: the guest's buffer capacities, read at trial instantiation.
        from_cache: the compiled code came from the disk cache.
        grow_observed: the host can tell a refused ``memory.grow`` (the module was rewritten).
        resettable: a kept instance can be put back to a new instance's state after each call
            (the rewrite added the fresh wrapper; :mod:`evald.host._instrument`), so
            ``isolation = "fresh"`` keeps it instead of instantiating per call.

    The underscored attributes belong to the host's own modules (loading writes the buffer
    addresses once, at the trial; instantiation reads them).
    """

    __slots__ = (
        "_eval_export",
        "_flag_export",
        "_fresh_export",
        "_input_ptr",
        "_minimum_memory_bytes",
        "_module",
        "_output_ptr",
        "_pre",
        "_pristine_bytes",
        "_pristine_pages",
        "from_cache",
        "grow_observed",
        "input_cap",
        "manifest",
        "output_cap",
        "resettable",
        "sha256",
        "size_bytes",
    )

    def __init__(
        self,
        *,
        manifest: Manifest,
        sha256: str,
        size_bytes: int,
        module: wasmtime.Module,
        pre: wasmtime.InstancePre,
        grow_observed: bool,
        resettable: bool = False,
        minimum_memory_bytes: int,
        input_cap: int,
        output_cap: int,
        from_cache: bool,
    ) -> None:
        self.manifest = manifest
        self.sha256 = sha256
        self.size_bytes = size_bytes
        self.input_cap = input_cap
        self.output_cap = output_cap
        self.from_cache = from_cache
        self.grow_observed = grow_observed
        self._module = module
        self._eval_export = EVAL_WRAPPER_EXPORT if grow_observed else EVAL_EXPORT
        self._flag_export = GROW_FLAG_EXPORT if grow_observed else None
        self.resettable = resettable
        self._fresh_export = FRESH_WRAPPER_EXPORT if resettable else None
        self._minimum_memory_bytes = minimum_memory_bytes
        self._input_ptr = self._output_ptr = 0  # set by the trial instantiation
        #: The memory a new instance has, from the trial: its size and its non-zero host pages
        #: (offset, bytes); what a reset puts back (:class:`evald.host._fastcall.MemoryReset`).
        self._pristine_bytes = 0
        self._pristine_pages: tuple[tuple[int, bytes], ...] = ()
        #: The module linked once (wasmtime ``InstancePre``): instantiation skips import
        #: resolution and type checks.
        self._pre = pre

    def __repr__(self) -> str:
        return (
            f"LoadedModule({self.manifest.name} {self.manifest.version}, "
            f"sha256={self.sha256[:12]}, {self.size_bytes} bytes)"
        )
