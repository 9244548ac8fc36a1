"""Registration's expensive step, validating and compiling an uploaded module, in a child process.

Why a process: validation reads and rewrites the module in pure Python (holding the GIL the
event loop needs) and wasmtime's compiler uses every core and cannot be interrupted. Run in the
daemon, one tenant registering 1 MiB modules back to back moved every other tenant's latency.
Here it runs in one spawned worker process at the lowest CPU priority (``nice 19``) with a CPU
time limit per module (``RLIMIT_CPU``; the kernel ends a compilation past it) and a wall-clock
limit, behind a bounded queue; the daemon only deserializes the result (about 0.1 ms) and
trial-instantiates it under the load budget.

Every registration compiles here, whatever was compiled before: nothing is looked up in a cache
keyed by the bytes, so registering bytes another tenant uploaded takes the same time as unseen
bytes (no cross-tenant oracle).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import resource
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import wasmtime

from evald.contract import EVAL_EXPORT, MANIFEST_SECTION, ErrorCode, EvaldError, Manifest
from evald.host._abi import WASM_PAGE_BYTES, inspect_module
from evald.host._instrument import GROW_FLAG_EXPORT, instrument_memory_grow
from evald.host._limits import HostConfig
from evald.host._wasm_binary import MAGIC, VERSION_1, Reader, WasmFormatError

__all__ = ["CompiledModule", "Compiler", "compile_module", "peek_manifest_section"]

_log = logging.getLogger("evald.compiler")
#: Compilations one worker process runs before it is replaced.
_TASKS_PER_WORKER = 32


@dataclass(frozen=True)
class CompiledModule:
    """What the child hands back: the checked manifest and wasmtime's serialized code."""

    manifest: Manifest
    minimum_memory_bytes: int
    grow_observed: bool
    code: bytes


def peek_manifest_section(wasm: bytes) -> bytes | None:
    """The payload of the module's one manifest section, reading only section headers.

    Cheap enough for the event loop's side of registration (the name and quota checks run on it
    before anything is compiled); None when the module is malformed or has no single manifest
    (the full validation then says why).
    """
    if wasm[:4] != MAGIC or wasm[4:8] != VERSION_1:
        return None
    found: list[bytes] = []
    try:
        reader = Reader(wasm, 8)
        while not reader.at_end():
            section_id = reader.byte()
            size = reader.uleb()
            start = reader.pos
            end = start + size
            if end > len(wasm):
                return None
            if section_id == 0:
                body = Reader(wasm, start, end)
                if body.name() == MANIFEST_SECTION:
                    found.append(bytes(wasm[body.pos : end]))
            reader.pos = end
    except (WasmFormatError, IndexError, ValueError):
        return None
    return found[0] if len(found) == 1 else None


def _engine(config: HostConfig) -> wasmtime.Engine:
    from evald.host._engine import make_engine_config

    return wasmtime.Engine(make_engine_config(config, pooling=config.pooling))


_ENGINES: dict[HostConfig, wasmtime.Engine] = {}


def compile_module(config: HostConfig, wasm: bytes, memory_cap: int) -> CompiledModule:
    """Validates ``wasm`` against the ABI and compiles it for ``config``'s engine settings.

    Runs in the worker process (or in-process for ``evald build`` and tests).

    Raises:
        EvaldError: ``INVALID_MODULE`` with the first rule the module breaks.
    """
    engine = _ENGINES.get(config)
    if engine is None:
        engine = _ENGINES[config] = _engine(config)
    manifest, info = inspect_module(
        wasm, max_module_bytes=config.module_bytes, max_memory_bytes=memory_cap, engine=engine
    )
    eval_index = next(e.index for e in info.exports if e.name == EVAL_EXPORT)
    try:
        code = instrument_memory_grow(wasm, info, eval_index) or wasm
    except Exception:  # the rewrite is an aid; never let it refuse a valid module
        code = wasm
    try:
        module = wasmtime.Module(engine, code)
    except wasmtime.WasmtimeError as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise EvaldError(
            ErrorCode.INVALID_MODULE, f"wasmtime cannot compile the module: {first}"
        ) from exc
    return CompiledModule(
        manifest=manifest,
        minimum_memory_bytes=info.memories[0].minimum_pages * WASM_PAGE_BYTES,
        grow_observed=any(e.name == GROW_FLAG_EXPORT for e in module.exports),
        code=bytes(module.serialize()),
    )


def _child_init() -> None:
    os.nice(19)


def _child_compile(
    config: HostConfig, wasm: bytes, memory_cap: int, cpu_s: float
) -> CompiledModule | tuple[str, str]:
    """The worker's task: one compilation under a fresh CPU-time allowance."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used + cpu_s) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    try:
        return compile_module(config, wasm, memory_cap)
    except EvaldError as exc:  # exceptions with extra fields do not pickle: send the parts
        return (exc.code.value, exc.message)


class Compiler:
    """One niced, CPU-limited worker process that compiles uploaded modules.

    ``compile`` blocks the calling thread (the daemon's control thread, which takes one
    registration at a time from a bounded queue), never the event loop. A compilation past its
    CPU or wall-clock limit ends the worker (a new one is started for the next) and is refused
    with ``invalid_module``.
    """

    def __init__(self, *, cpu_s: float, wall_s: float) -> None:
        self._cpu_s = cpu_s
        self._wall_s = wall_s
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise EvaldError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_child_init,
                    # a fresh worker now and then: what compilations leave behind is returned
                    max_tasks_per_child=_TASKS_PER_WORKER,
                )
            return self._pool

    def _reset(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            processes: dict[Any, Any] = dict(getattr(pool, "_processes", None) or {})
            for process in processes.values():
                with contextlib.suppress(OSError):
                    process.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def compile(self, config: HostConfig, wasm: bytes, memory_cap: int) -> CompiledModule:
        """Validates and compiles ``wasm`` in the worker.

        Raises:
            EvaldError: ``invalid_module`` (refused, or over the CPU or time limit),
                ``unavailable`` (the daemon is stopping).
        """
        future = self._executor().submit(_child_compile, config, wasm, memory_cap, self._cpu_s)
        try:
            result = future.result(timeout=self._wall_s)
        except concurrent.futures.TimeoutError:
            self._reset()
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"compiling the module took longer than {self._wall_s:g} s; an evaluator "
                "compiles in milliseconds (build with -O ReleaseSmall, fewer functions)",
            ) from None
        except BrokenProcessPool:
            self._reset()
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"compiling the module used more than {self._cpu_s:g} s of CPU or the "
                "compiler failed; an evaluator compiles in milliseconds",
            ) from None
        if isinstance(result, tuple):
            code, message = result
            raise EvaldError(ErrorCode(code), message)
        return result

    def close(self) -> None:
        """Stops the worker process (pending compilations are refused)."""
        with self._lock:
            self._closed = True
        self._reset()
