"""Runs the compilers of one build in a sandbox: a tenant's folder is code that runs at build time.

A folder's sources steer the compiler (Zig ``comptime``, C ``#embed``, Rust ``include_bytes!``,
const evaluation), so whatever the compiler can read or do on the builder's machine, the folder
can too, and a read file ends up in the module, which answers whoever calls it. Each compiler
run of a build therefore runs under `bubblewrap <https://github.com/containers/bubblewrap>`_
(``bwrap``), the unprivileged sandbox Flatpak builds on:

* **file system**: a new, read-only root holding ``/usr`` (and the ``/bin``, ``/lib*`` links
  into it), ``/etc/ld.so.cache`` and ``/etc/alternatives``, four device nodes (``null``,
  ``zero``, ``random``, ``urandom``), the folder read-only, the compiler's own folders
  read-only (:attr:`Compiler.needs <evald.sdk._compiler.Compiler.needs>`: the ziglang package,
  a Rust sysroot outside ``/usr``, the asc package, the SDK's guest libraries), and one scratch
  folder, the only writable place (``HOME``, ``TMPDIR``, the caches and the output);
* **namespaces**: new user, PID, network (no interface but a loopback), IPC, UTS and cgroup
  namespaces, a new ``/proc`` for the new PID namespace (``/proc/self/environ`` is the clean
  environment below, and no process of the builder is visible), a new session (no terminal to
  inject input into), every capability dropped, and the sandbox dies with the build;
* **environment**: only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and what the compiler needs
  (its cache folders); ``bwrap`` itself is started with the same, so nothing of the operator's
  environment is anywhere inside;
* **limits** (:class:`BuildLimits`): a wall clock for the whole build, after which every
  process of the sandbox is killed (the PID namespace ends with its first process), and per
  process CPU seconds, memory (``RLIMIT_DATA``: heap and writable mappings, not the address
  space Node.js and V8 reserve), file size, and process count.

Without ``bwrap`` a build is refused, saying how to install it, unless the operator asks for
:attr:`BuildSandbox.unsandboxed`: the limits, the clean environment, the scratch folder and the
killing of the process group still apply, the file system view and the namespaces do not.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final

from evald.contract import ErrorCode, EvaldError
from evald.daemon import child_start
from evald.sdk._compiler import BuildError

__all__ = [
    "DEFAULT_LIMITS",
    "BuildLimits",
    "BuildSandbox",
    "Scratch",
    "find_bwrap",
]

#: What a compiler may read of the system besides ``/usr``: the dynamic linker's cache and
#: Debian's alternatives links (``/usr/bin/x -> /etc/alternatives/x -> ...``).
_SYSTEM_ETC: Final = ("/etc/ld.so.cache", "/etc/alternatives")
#: The top-level links (or folders) of a merged-/usr system.
_SYSTEM_LINKS: Final = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES: Final = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
#: How much of a compiler's output is kept (its diagnostics come first; the rest is cut).
_OUTPUT_BYTES: Final = 1 << 20
#: How long the end of a killed sandbox may take (the kernel kills its processes at once).
_REAP_S: Final = 30.0
_INSTALL_BWRAP: Final = (
    "install bubblewrap (`apt-get install bubblewrap` on Debian or Ubuntu, `dnf install "
    "bubblewrap` on Fedora), or pass --unsandboxed to build without it (dangerous: the "
    "folder's compile-time code then reads what you can read and reaches the network)"
)


@dataclass(frozen=True)
class BuildLimits:
    """The limits of one build (``evald build --timeout/--cpu-seconds/--memory-mib``;
    ``--build-timeout`` is ``--timeout`` for ``evald register``).

    Attributes:
        timeout_s: wall-clock seconds for the whole build (every compiler run together); past
            them every process of the build is killed. Generous: the repository's builds take
            6 to 11 s each on two busy cores, cold caches included.
        cpu_s: CPU seconds per process (``RLIMIT_CPU``; ``SIGXCPU``, then ``SIGKILL``).
        memory_bytes: heap and writable memory per process (``RLIMIT_DATA``); the
            repository's builds peak under 300 MiB resident (asc on the AssemblyScript port).
        file_bytes: the largest file a build may write (``RLIMIT_FSIZE``).
        processes: processes and threads the build may add (``RLIMIT_NPROC``, counted above
            what the builder's user runs already; Linux does not apply it to root).
    """

    timeout_s: float = 300.0
    cpu_s: int = 300
    memory_bytes: int = 2 << 30
    file_bytes: int = 256 << 20
    processes: int = 256

    def describe(self) -> str:
        """The limits in one line, for messages."""
        return (
            f"{self.timeout_s:g} s wall clock for the build (--timeout), {self.cpu_s} CPU "
            f"seconds (--cpu-seconds) and {self.memory_bytes >> 20} MiB of memory "
            f"(--memory-mib) per process, files up to {self.file_bytes >> 20} MiB, "
            f"{self.processes} more processes"
        )


DEFAULT_LIMITS: Final = BuildLimits()


@dataclass(frozen=True)
class BuildSandbox:
    """How a build runs its compilers.

    Attributes:
        limits: the build's limits.
        unsandboxed: run without ``bwrap`` (``--unsandboxed``, dangerous: only for sources
            you trust); the limits and the clean environment still apply.
        toolchain_from_folder: take asc from the folder's own ``node_modules``
            (``--toolchain-from-folder``, dangerous: the folder then chooses its compiler,
            which still runs in the sandbox).
    """

    limits: BuildLimits = field(default_factory=BuildLimits)
    unsandboxed: bool = False
    toolchain_from_folder: bool = False


@functools.cache
def _bwrap_works(bwrap: str) -> str | None:
    """None when ``bwrap`` can make the sandbox here, else why not (its own words)."""
    command = [bwrap, *_NAMESPACES, "--ro-bind", "/usr", "/usr", *_system_links(),
               "--", "/usr/bin/true"]  # fmt: skip
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env={})
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


def find_bwrap() -> str:
    """The ``bwrap`` the sandbox runs with, checked to work here.

    Raises:
        EvaldError: ``INVALID_ARGUMENT``: no ``bwrap``, or it cannot make namespaces here
            (the message says what to install or allow, and the ``--unsandboxed`` way out).
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None or not os.path.isabs(bwrap):
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            "evald build runs a folder's compilers in a sandbox, and bwrap (bubblewrap) is not "
            f"installed: {_INSTALL_BWRAP}",
        )
    problem = _bwrap_works(bwrap)
    if problem is not None:
        raise EvaldError(
            ErrorCode.INVALID_ARGUMENT,
            f"{bwrap} cannot make the build's sandbox here ({problem}); it needs user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 on older Debian, "
            "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap "
            "on Ubuntu 24.04; in a container, one allowed to create namespaces); or pass "
            "--unsandboxed to build without it (dangerous: only for sources you trust)",
        )
    return bwrap


_NAMESPACES: Final = (
    "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
    "--hostname", "evald-build",
)  # fmt: skip


def _system_links() -> list[str]:
    args: list[str] = []
    for top in _SYSTEM_LINKS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _processes_of_user(uid: int) -> int:
    """Processes and threads the user runs now (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":", 1) for line in status.read_text().splitlines() if ":" in line
            )
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _rlimits(limits: BuildLimits) -> dict[int, tuple[int, int]]:
    """(soft, hard) for each limit, at most the builder's own hard limit (an unprivileged process
    cannot raise one). CPU: SIGXCPU at the soft limit (which names it), SIGKILL a second later."""
    uid = os.getuid()
    wanted = {
        resource.RLIMIT_CPU: limits.cpu_s,
        resource.RLIMIT_DATA: limits.memory_bytes,
        resource.RLIMIT_FSIZE: limits.file_bytes,
        resource.RLIMIT_NPROC: limits.processes + (0 if uid == 0 else _processes_of_user(uid)),
        resource.RLIMIT_CORE: 0,
    }
    chosen = {}
    for which, value in wanted.items():
        hard = resource.getrlimit(which)[1]
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        grace = soft + 1 if which == resource.RLIMIT_CPU else soft
        chosen[which] = (soft, grace if hard == resource.RLIM_INFINITY else min(grace, hard))
    return chosen


class Scratch:
    """One build's scratch folder and deadline; :meth:`run` runs a compiler in the sandbox.

    Use as a context manager: the folder is removed at the end, whatever the compilers left.
    """

    def __init__(self, sandbox: BuildSandbox, folder: Path) -> None:
        self.sandbox = sandbox
        self.folder = folder
        self._bwrap = None if sandbox.unsandboxed else find_bwrap()
        self._deadline = time.monotonic() + sandbox.limits.timeout_s
        self._rlimits = _rlimits(sandbox.limits)
        self.root = Path(tempfile.mkdtemp(prefix="evald-build-")).resolve()
        self.out = self.root / "out"
        for name in ("home", "tmp", "out", "cache"):
            (self.root / name).mkdir()

    def __enter__(self) -> Scratch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for path, dirs, _ in os.walk(self.root):  # a build may have taken its own rights away
            for name in dirs:
                os.chmod(os.path.join(path, name), 0o700)
        shutil.rmtree(self.root, ignore_errors=True)

    def environment(self, extra: Mapping[str, str], path: Iterable[str] = ()) -> dict[str, str]:
        """The whole environment of a compiler run: nothing of the operator's."""
        return {
            "PATH": ":".join([*path, "/usr/bin", "/bin"]),
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "LANG": "C.UTF-8",
            **extra,
        }

    def run(
        self,
        command: Sequence[str],
        *,
        what: str,
        cwd: Path,
        needs: Iterable[Path] = (),
        env: Mapping[str, str] | None = None,
        path: Iterable[str] = (),
    ) -> str:
        """Runs one compiler; returns its output (stdout and stderr together).

        Parameters:
            command: the compiler's argv (absolute paths, visible in the sandbox).
            what: what is compiled, for messages (``main.zig``).
            cwd: its working folder (the build's folder or one it needs).
            needs: folders the compiler reads, exposed read-only.
            env: variables besides PATH, HOME, TMPDIR and LANG.
            path: folders put before ``/usr/bin:/bin`` on PATH.

        Raises:
            BuildError: the compiler failed, was killed by a limit, or outlived the build's
                wall clock (every process of the build is then killed).
        """
        environment = self.environment(env or {}, path)
        number = len(list(self.root.glob("*.log")))
        log_path, info_path = self.root / f"{number}.log", self.root / f"{number}.info"
        with open(log_path, "wb") as log, open(info_path, "wb") as info:
            argv, keep = list(command), tuple[int, ...]()
            if self._bwrap is not None:
                view = self._view(cwd, needs, environment)
                argv, keep = [*view, "--info-fd", str(info.fileno()), "--", *argv], (info.fileno(),)
            # The limits through prlimit, not a preexec_fn: the builder may hold gRPC (a test,
            # an SDK user's service) and must not fork (evald.daemon.child_start).
            start = child_start(argv, rlimits=self._rlimits)
            try:
                proc = subprocess.Popen(
                    start.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=cwd, env=environment, start_new_session=True, pass_fds=keep,
                    preexec_fn=start.preexec_fn,
                )  # fmt: skip
            except OSError as exc:
                raise EvaldError(
                    ErrorCode.INVALID_ARGUMENT, f"cannot run {argv[0]}: {exc.strerror}"
                ) from None
            cpu_s: float | None = None
            try:
                cpu_s = _wait(proc, self._deadline)
            finally:
                _stop(proc, info_path)
        output = _read_output(log_path)
        if cpu_s is None:
            raise BuildError(
                f"compiling {what} did not finish within the build's wall-clock limit of "
                f"{self.sandbox.limits.timeout_s:g} s (--timeout); every process of the build "
                "was killed",
                output,
            )
        if proc.returncode != 0:
            raise BuildError(
                _failure(what, proc.returncode, output, self.sandbox.limits, cpu_s), output
            )
        return output

    def _view(self, cwd: Path, needs: Iterable[Path], env: Mapping[str, str]) -> list[str]:
        assert self._bwrap is not None
        args = [self._bwrap, *_NAMESPACES, "--ro-bind", "/usr", "/usr", *_system_links()]
        for path in _SYSTEM_ETC:
            args += ["--ro-bind-try", path, path]
        for device in _DEVICES:
            args += ["--dev-bind", device, device]
        args += ["--proc", "/proc"]
        for need in dict.fromkeys(Path(p).resolve() for p in needs):
            if not need.is_relative_to("/usr"):
                args += ["--ro-bind", str(need), str(need)]
        args += ["--ro-bind", str(self.folder), str(self.folder)]
        args += ["--bind", str(self.root), str(self.root), "--remount-ro", "/"]
        for name, value in env.items():
            args += ["--setenv", name, value]
        return [*args, "--chdir", str(cwd)]


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> float | None:
    """Waits for ``proc`` until ``deadline`` (``time.monotonic``) and reaps it; returns the CPU
    seconds ``wait4`` says it and the processes it reaped used, or None if the deadline came
    first. Unsandboxed, that is the compiler's own time, the one account of a run the kernel
    killed at the hard CPU limit (``Popen.wait`` gives none); bwrap's outer process does not
    reap its namespace, so for a sandboxed run it is bwrap's own time, near zero."""
    pause = 0.001
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def _stop(proc: subprocess.Popen[bytes], info_path: Path) -> None:
    """Ends what is left of a run and reaps it. In the sandbox, the PID namespace's first
    process (bwrap's ``child-pid``) is killed: the kernel then kills every process of the
    namespace, and bwrap returns only once they are all gone, so none outlives the build.
    Then the run's process group (all of an unsandboxed run, whose compilers start no
    session of their own)."""
    if proc.poll() is None:
        try:
            child = int(json.loads(info_path.read_bytes() or b"{}").get("child-pid", 0))
        except (OSError, ValueError, AttributeError):
            child = 0
        if child > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_REAP_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_output(log_path: Path) -> str:
    with open(log_path, "rb") as log:
        data = log.read(_OUTPUT_BYTES + 1)
    text = data[:_OUTPUT_BYTES].decode("utf-8", errors="replace")
    return text + ("\n[output cut at 1 MiB]\n" if len(data) > _OUTPUT_BYTES else "")


#: What the compilers print when an allocation fails (Zig, rustc/LLVM, Node.js, libc).
_OUT_OF_MEMORY: Final = (
    "OutOfMemory", "SystemResources", "out of memory", "memory allocation of",
    "Cannot allocate memory", "heap out of memory",
)  # fmt: skip


def _failure(
    what: str, returncode: int, output: str, limits: BuildLimits, cpu_s: float | None = None
) -> str:
    """Why a compiler run failed, naming a limit when a signal ended it or memory ran out.

    ``cpu_s``: the CPU seconds the run used, every process of it together. The kernel sends
    ``SIGXCPU`` at the CPU limit and ``SIGKILL`` a CPU second later; a compiler that outlives
    the first (one that ignores it, or one whose threads kept it from acting on it in time)
    ends by the second, which is still the CPU limit when the run used that much."""
    signum = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    at_cpu_limit = cpu_s is not None and cpu_s >= limits.cpu_s
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and at_cpu_limit):
        return (
            f"compiling {what} was stopped: a compiler process used the build's {limits.cpu_s} "
            "CPU seconds (--cpu-seconds)"
        )
    if signum in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGXFSZ):
        return (
            f"compiling {what} failed: the compiler was killed by {signal.Signals(signum).name} "
            f"(the build's limits: {limits.describe()})"
        )
    if any(sign in output for sign in _OUT_OF_MEMORY):
        return (
            f"compiling {what} failed: the compiler ran out of memory or another resource (the "
            f"build's memory limit is {limits.memory_bytes >> 20} MiB per process: --memory-mib)"
        )
    return f"compiling {what} failed"
