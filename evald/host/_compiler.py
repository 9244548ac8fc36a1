"""Registration's expensive step, validating and compiling an uploaded module, in a child process.

Why a process: validation reads and rewrites the module in pure Python (holding the GIL the
event loop needs) and wasmtime's compiler cannot be interrupted. Run in the daemon, one tenant
registering 1 MiB modules back to back moved every other tenant's latency. Here it runs in one
spawned worker process, itself a sandbox:

* CPU: the lowest priority (``nice 19``), one compiler thread, and a CPU-time limit per module
  (``RLIMIT_CPU``; the kernel ends a compilation past it) plus a wall-clock limit.
* Memory: ``RLIMIT_DATA`` of ``memory_bytes``. Not ``RLIMIT_AS``: wasmtime reserves address
  space it never touches (guard regions; the pooling allocator's slots reserve tens of GiB for
  an engine configured like the daemon's in ``fresh`` mode), and an address-space limit would
  refuse those reservations, not the memory a compilation really uses. ``RLIMIT_DATA`` counts
  what the process made writable (heap, anonymous mappings, thread stacks), which is where a
  compilation's memory goes. Not a cgroup: the daemon would need a delegated cgroup of its own
  (systemd ``Delegate=``, root elsewhere), and the limit must hold wherever the daemon runs.
  A compilation past the limit fails its allocation and the worker ends; the caller gets
  ``invalid_module`` saying so. What a function costs the compiler is also checked before it
  compiles (:mod:`evald.host._compile_cost`), so the known expensive shapes are refused early.
* Lifetime: the worker watches a pipe whose only writer is the daemon; when the daemon dies
  (``kill -9`` included) the pipe ends and the worker exits, and multiprocessing's resource
  tracker, which stays only while a process holds its pipe, follows. A pipe rather than
  ``PR_SET_PDEATHSIG``: the death signal follows the *thread* that started the worker, and the
  pool starts replacement workers from its own threads.
* Shutdown: :meth:`Compiler.stop` refuses new compilations and gives the running one until a
  deadline; past it the worker is killed and the caller gets ``unavailable``.

The daemon only deserializes the result (about 0.1 ms) and trial-instantiates it under the
load budget.

Every registration compiles here, whatever was compiled before: nothing is looked up in a cache
keyed by the bytes, so registering bytes another tenant uploaded takes the same time as unseen
bytes (no cross-tenant oracle).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import math
import multiprocessing
import os
import resource
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

import wasmtime

from evald.contract import EVAL_EXPORT, MANIFEST_SECTION, ErrorCode, EvaldError, Manifest
from evald.host._abi import WASM_PAGE_BYTES, inspect_module
from evald.host._compile_cost import check_compile_cost
from evald.host._instrument import GROW_FLAG_EXPORT, instrument_memory_grow
from evald.host._limits import HostConfig
from evald.host._wasm_binary import MAGIC, VERSION_1, Reader, WasmFormatError

__all__ = [
    "DEFAULT_COMPILE_MEMORY_BYTES",
    "CompiledModule",
    "Compiler",
    "compile_module",
    "peek_manifest_section",
]

_log = logging.getLogger("evald.compiler")
#: Compilations one worker process runs before it is replaced.
_TASKS_PER_WORKER = 32
#: The worker's memory limit unless the caller gives one (``[server] compile_memory_bytes``).
DEFAULT_COMPILE_MEMORY_BYTES: Final = 512 * 2**20
#: What the worker answers when Python's side of a compilation ran out of memory.
_OVER_MEMORY: Final = "over_memory"
#: ``prctl`` option: whether the kernel may dump the process's memory (linux/prctl.h).
_PR_SET_DUMPABLE: Final = 4
#: How long a worker that broke the pool may take to be reaped, its exit status telling why.
_REAP_S: Final = 10.0


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

    # The pool's size does not change the compiled code (a daemon's engine of any pool size
    # deserializes it); one slot keeps the worker's own pool out of its RLIMIT_DATA.
    engine_config = make_engine_config(
        dataclasses.replace(config, pool_instances=1), pooling=config.pooling
    )
    # One function at a time: the memory a compilation needs is then that of its costliest
    # function (docs/design.md §5), not of as many functions as the machine has cores. The
    # code is the same; the daemon's engine deserializes it.
    engine_config.parallel_compilation = False
    return wasmtime.Engine(engine_config)


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
    check_compile_cost(wasm, info)
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


def _no_core_dumps() -> None:
    """A refused allocation aborts the worker; it must end at once, without a core dump.

    Where core dumps are on (``ulimit -c unlimited``, or a ``core_pattern`` pipe to a
    collector), the kernel would write out the worker's memory first, wasmtime's reservations
    included: seconds during which its exit status is unknown, and a file holding the tenant's
    module. ``RLIMIT_CORE`` of 0 stops a dump to a file; not dumpable stops one to a pipe too
    (and keeps other processes of the same user from attaching to the worker).
    """
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _child_init(parent: Connection, memory_bytes: int) -> None:
    """The worker's set-up: lowest CPU priority, the memory limit, and the watch on the daemon."""
    os.nice(19)
    os.environ["RUST_BACKTRACE"] = "0"  # a refused allocation prints one line, not a backtrace
    _no_core_dumps()
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))

    def watch() -> None:
        try:
            while parent.recv_bytes():
                pass  # the daemon never writes
        except (EOFError, OSError):
            pass
        os._exit(0)  # the daemon is gone: nobody will ever read what this worker compiles

    threading.Thread(target=watch, name="evald-compile-parent", daemon=True).start()


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
    except MemoryError:  # Python's side ran out under RLIMIT_DATA (wasmtime's side aborts)
        return (_OVER_MEMORY, "")


#: A compilation stopped at its wall-clock limit with less CPU than this share of that limit
#: was starved by the machine's load, not slow: its caller gets ``unavailable``.
_STARVED_SHARE: Final = 0.5


def _cpu_seconds(workers: list[Any]) -> float | None:
    """CPU time (user + system) the worker processes have used so far, from ``/proc``; None
    where that cannot be read (not Linux, or already gone)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for process in workers:
        try:
            with open(f"/proc/{process.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, AttributeError, IndexError, TypeError):
            return None
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / ticks


class Compiler:
    """One niced, CPU- and memory-limited worker process that compiles uploaded modules.

    ``compile`` blocks the calling thread (the daemon's control thread, which takes one
    registration at a time from its queue), never the event loop. A compilation past its CPU,
    memory or wall-clock limit ends the worker (a new one is started for the next) and is
    refused with ``invalid_module`` (but one that reached the wall-clock limit with little CPU
    was starved by the machine's load: ``unavailable``); one still running when
    :meth:`stop`'s deadline passes ends the same way and is refused with ``unavailable``.
    """

    def __init__(
        self,
        *,
        cpu_s: float = 10.0,
        wall_s: float = 30.0,
        memory_bytes: int = DEFAULT_COMPILE_MEMORY_BYTES,
    ) -> None:
        self._cpu_s = cpu_s
        self._wall_s = wall_s
        self._memory_bytes = memory_bytes
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False
        self._stop_at = math.inf
        # The worker's watch: it holds the read end; the write end stays here, with nobody else.
        context = multiprocessing.get_context("spawn")
        self._context = context
        self._parent_watch, self._parent_link = context.Pipe(duplex=False)

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise EvaldError(
                    ErrorCode.UNAVAILABLE,
                    "the daemon is shutting down; register the module again once it is back",
                )
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=self._context,
                    initializer=_child_init,
                    initargs=(self._parent_watch, self._memory_bytes),
                    # a fresh worker now and then: what compilations leave behind is returned
                    max_tasks_per_child=_TASKS_PER_WORKER,
                )
            return self._pool

    def _workers(self) -> list[Any]:
        with self._lock:
            pool = self._pool
        return list((getattr(pool, "_processes", None) or {}).values()) if pool else []

    def _reset(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                with contextlib.suppress(OSError, ValueError):
                    process.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def warm(self) -> None:
        """Starts the worker now rather than at the first compilation: a fleet daemon compiles
        the modules other daemons registered, and the first should not wait for a process to
        start (about a second)."""
        with contextlib.suppress(EvaldError):
            self._executor().submit(os.getpid)

    def compile(self, config: HostConfig, wasm: bytes, memory_cap: int) -> CompiledModule:
        """Validates and compiles ``wasm`` in the worker.

        Raises:
            EvaldError: ``invalid_module`` (refused, or over the CPU, memory or time limit),
                ``unavailable`` (the daemon is stopping).
        """
        future = self._executor().submit(_child_compile, config, wasm, memory_cap, self._cpu_s)
        workers = self._workers()
        future.add_done_callback(self._notify)
        give_up = time.monotonic() + self._wall_s
        with self._changed:
            while not future.done():
                remaining = min(give_up, self._stop_at) - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            stopped = not future.done() and time.monotonic() >= self._stop_at
        if not future.done():
            cpu_s = _cpu_seconds(workers)
            self._reset()
            if stopped:
                raise EvaldError(
                    ErrorCode.UNAVAILABLE,
                    "the daemon is shutting down: the module's compilation was ended at the "
                    "shutdown grace period; register it again once the daemon is back",
                )
            if cpu_s is not None and cpu_s < _STARVED_SHARE * self._wall_s:
                # The worker is niced so that evaluations come first: on a machine kept busy it
                # can wait out its wall-clock limit with little CPU. That says nothing about the
                # module, so the caller is told to retry, not that the module is refused.
                raise EvaldError(
                    ErrorCode.UNAVAILABLE,
                    f"the machine was too busy to compile the module within "
                    f"{self._wall_s:g} s (the compile worker, at the lowest priority, got "
                    f"{cpu_s:.1f} s of CPU); retry when it is less loaded",
                )
            raise EvaldError(
                ErrorCode.INVALID_MODULE,
                f"compiling the module took longer than {self._wall_s:g} s; an evaluator "
                "compiles in milliseconds (build with -O ReleaseSmall, fewer functions)",
            )
        try:
            result = future.result()
        except (BrokenProcessPool, concurrent.futures.CancelledError):
            died = self._worker_died(workers)  # before _reset kills what is left
            self._reset()
            raise died from None
        if isinstance(result, tuple):
            code, message = result
            if code == _OVER_MEMORY:
                raise self._over_memory()
            raise EvaldError(ErrorCode(code), message)
        return result

    def _notify(self, _future: object) -> None:
        with self._changed:
            self._changed.notify_all()

    def _over_memory(self) -> EvaldError:
        return EvaldError(
            ErrorCode.INVALID_MODULE,
            f"compiling the module needed more than {self._memory_bytes // 2**20} MiB of "
            "memory (compile_memory_bytes); an evaluator compiles in a few MiB: split large "
            "functions and use fewer locals",
        )

    def _worker_died(self, workers: list[Any]) -> EvaldError:
        """Why the worker ended mid-compilation, from how it ended."""
        with self._lock:
            if self._closed:
                return EvaldError(
                    ErrorCode.UNAVAILABLE,
                    "the daemon is shutting down: the module's compilation was ended at the "
                    "shutdown grace period; register it again once the daemon is back",
                )
        codes = set()
        give_up = time.monotonic() + _REAP_S
        for process in workers:
            with contextlib.suppress(ValueError, AttributeError, AssertionError):
                # The pool's own thread reaps its broken workers too: a join that loses that
                # race returns before the exit status is recorded, so look again.
                while process.exitcode is None and time.monotonic() < give_up:
                    process.join(timeout=0.05)
                codes.add(process.exitcode)
        if -signal.SIGXCPU in codes:
            return EvaldError(
                ErrorCode.INVALID_MODULE,
                f"compiling the module used more than {self._cpu_s:g} s of CPU "
                "(compile_cpu_s); an evaluator compiles in milliseconds",
            )
        if -signal.SIGABRT in codes:  # wasmtime aborts when an allocation is refused
            return self._over_memory()
        return EvaldError(
            ErrorCode.INVALID_MODULE,
            f"the compiler ended without a result (exit status {sorted(codes, key=str)}); "
            "the module was not registered",
        )

    def stop(self, grace_s: float) -> None:
        """Refuses new compilations from now on; one running may go on for ``grace_s``, then
        it is ended and its caller gets ``unavailable``. Does not wait."""
        with self._changed:
            self._closed = True
            self._stop_at = min(self._stop_at, time.monotonic() + max(0.0, grace_s))
            self._changed.notify_all()

    def close(self) -> None:
        """Stops the worker process now (a running compilation is refused with
        ``unavailable``, pending ones too)."""
        self.stop(0.0)
        self._reset()
        # Let any worker the pool started behind our back go as well: it reads end-of-file and
        # exits. Without this, one left running would deadlock the daemon's exit, where
        # multiprocessing joins its children while they wait for the daemon to end.
        for end in (self._parent_link, self._parent_watch):
            with contextlib.suppress(OSError):
                end.close()
