"""A module the host has accepted: validated, compiled and trial-instantiated once.

"Compile once, instantiate many": loading (:mod:`evald.host._module_loader`) does the expensive
and the risky work a single time and records what every later instance needs — the compiled
code, which export to call, and where the guest's buffers lie — so a new instance
(:mod:`evald.host._instance`) is cheap and calls no guest function but ``evald_eval``.

Two stages, each complete when made, none changed after:

* :class:`LinkedModule`: the compiled code linked once (wasmtime's ``InstancePre``) and which
  exports an instance binds — all that starting an instance needs, so the trial can start one;
* :class:`LoadedModule`: a linked module with what its trial found (:class:`TrialImage`: the
  buffers, the memory a new instance has) — what every call's instance is made from.

The host's other modules read both through read-only properties; nothing outside this module
writes them, and the wasmtime objects they hold live exactly as long as the module does.
"""

from __future__ import annotations

from dataclasses import dataclass

import wasmtime

from evald.contract import EVAL_EXPORT, Manifest
from evald.host._instrument import EVAL_WRAPPER_EXPORT, FRESH_WRAPPER_EXPORT, GROW_FLAG_EXPORT

__all__ = ["LinkedModule", "LoadedModule", "TrialImage"]


@dataclass(frozen=True, slots=True)
class TrialImage:
    """What the trial instantiation found, true of every later instance (a guest without
    imports is deterministic).

    Attributes:
        input_ptr, input_cap, output_ptr, output_cap: the guest's buffers.
        pristine_bytes: the memory size of a new instance, read before any guest function ran.
        pristine_pages: its non-zero host pages, ``(offset, bytes)``; what a reset puts back
            (:class:`evald.host._memory_reset.MemoryReset`; empty unless the module is resettable).
    """

    input_ptr: int
    input_cap: int
    output_ptr: int
    output_cap: int
    pristine_bytes: int
    pristine_pages: tuple[tuple[int, bytes], ...] = ()


class LinkedModule:
    """A compiled module linked once: what starting an instance needs.

    Attributes (plain, read on every call; written only here):
        manifest: the module's manifest.
        sha256: hex SHA-256 of the module bytes as uploaded (its identity).
        size_bytes: size of the module as uploaded.
        from_cache: the compiled code came from the disk cache.
        grow_observed: the host can tell a refused ``memory.grow`` (the module was rewritten).
        resettable: a kept instance can be put back to a new instance's state after each call
            (the rewrite added the fresh wrapper; :mod:`evald.host._instrument`), so
            ``isolation = "fresh"`` keeps it instead of instantiating per call.
    """

    __slots__ = (
        "_code",
        "_minimum_memory_bytes",
        "_pre",
        "from_cache",
        "grow_observed",
        "manifest",
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
        code: wasmtime.Module,
        pre: wasmtime.InstancePre,
        grow_observed: bool,
        resettable: bool = False,
        minimum_memory_bytes: int,
        from_cache: bool,
    ) -> None:
        self.manifest = manifest
        self.sha256 = sha256
        self.size_bytes = size_bytes
        self.from_cache = from_cache
        self.grow_observed = grow_observed
        self.resettable = resettable
        self._code = code
        self._pre = pre
        self._minimum_memory_bytes = minimum_memory_bytes

    @property
    def code(self) -> wasmtime.Module:
        """The compiled code (what the disk cache stores)."""
        return self._code

    @property
    def pre(self) -> wasmtime.InstancePre:
        """The module linked once: instantiation skips import resolution and type checks."""
        return self._pre

    @property
    def minimum_memory_bytes(self) -> int:
        """The memory the module declares it needs at start (its minimum pages, in bytes)."""
        return self._minimum_memory_bytes

    @property
    def eval_export(self) -> str:
        """The export a call enters: the rewrite's wrapper when it observes ``memory.grow``."""
        return EVAL_WRAPPER_EXPORT if self.grow_observed else EVAL_EXPORT

    @property
    def flag_export(self) -> str | None:
        """The global that records a refused ``memory.grow``; None when not rewritten."""
        return GROW_FLAG_EXPORT if self.grow_observed else None

    @property
    def fresh_export(self) -> str | None:
        """The export a reset instance's call enters (globals put back first); None when the
        module is not resettable."""
        return FRESH_WRAPPER_EXPORT if self.resettable else None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.manifest.name} {self.manifest.version}, "
            f"sha256={self.sha256[:12]}, {self.size_bytes} bytes)"
        )


class LoadedModule(LinkedModule):
    """A validated, compiled, trial-instantiated module; cheap to instantiate, shared by all
    threads.

    Attributes:
        input_cap, output_cap: the guest's buffer capacities (plain: read on every call).
    """

    __slots__ = ("_trial", "input_cap", "output_cap")

    def __init__(self, linked: LinkedModule, trial: TrialImage) -> None:
        super().__init__(
            manifest=linked.manifest,
            sha256=linked.sha256,
            size_bytes=linked.size_bytes,
            code=linked.code,
            pre=linked.pre,
            grow_observed=linked.grow_observed,
            resettable=linked.resettable,
            minimum_memory_bytes=linked.minimum_memory_bytes,
            from_cache=linked.from_cache,
        )
        self._trial = trial
        self.input_cap = trial.input_cap
        self.output_cap = trial.output_cap

    @property
    def trial(self) -> TrialImage:
        """What the trial instantiation found: the buffers and a new instance's memory."""
        return self._trial
