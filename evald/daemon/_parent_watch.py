"""A daemon started by another program dies with it, however that program dies.

A program that starts ``evald serve`` as its child (the demo, the test harness, ``evald fuzz``,
``evald bench``, the GPU check) normally stops it with SIGTERM on the way out; but a parent killed
by SIGKILL, a segmentation fault or the OOM killer runs no clean-up, and its daemon would keep
serving with nobody to stop it. The parent therefore holds the write end of a pipe that only it
has (:class:`ParentLink`) and passes the read end to the daemon (``evald serve --parent-fd FD``).
The kernel closes the write end when the parent exits for any reason; the daemon's watcher thread
(:func:`watch_parent`) then reads end-of-file and stops the daemon as SIGTERM would: drain, then
exit, and a second SIGTERM after the drain grace if the drain has not finished.

A pipe rather than ``PR_SET_PDEATHSIG``: the death signal fires when the *thread* that forked the
child exits, so a daemon started from a worker thread would be killed while its parent lives on.
The pipe's write end belongs to the process, and no other child inherits it (it is opened
close-on-exec and passed to the one daemon only).
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["PARENT_FD_FLAG", "ParentLink", "watch_parent"]

#: The ``evald serve`` option that names the inherited read end.
PARENT_FD_FLAG = "--parent-fd"


class ParentLink:
    """The parent's side: a pipe whose read end goes to one child and whose write end stays here.

    Use :meth:`child_args` in the child's command line and :attr:`pass_fds` in ``Popen``; call
    :meth:`spawned` once the child runs (closes the parent's copy of the read end) and
    :meth:`close` when the child should go (the child then stops as on SIGTERM). Closing is
    idempotent. Not thread-safe.
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()  # both close-on-exec: nobody else inherits them

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """The descriptors ``Popen(pass_fds=...)`` must hand to the child."""
        return (self._read_fd,) if self._read_fd >= 0 else ()

    def child_args(self) -> list[str]:
        """``["--parent-fd", "N"]`` for the child's ``evald serve`` command line."""
        if self._read_fd < 0:
            raise RuntimeError("this link was already handed to a child")
        return [PARENT_FD_FLAG, str(self._read_fd)]

    def spawned(self) -> None:
        """Closes the parent's copy of the read end (the child has its own)."""
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1

    def close(self) -> None:
        """Lets the child go: it reads end-of-file and stops."""
        self.spawned()
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1


def watch_parent(fd: int, *, grace_s: float) -> threading.Thread:
    """Stops this process when ``fd`` reaches end-of-file (the parent is gone or let go).

    Parameters:
        fd: the inherited read end of the parent's pipe; owned by the watcher from now on.
        grace_s: how long the drain that SIGTERM starts may take before a second SIGTERM
            makes the daemon leave at once.

    Returns:
        The started watcher thread (a daemon thread blocked in ``read``; it holds no lock).

    Raises:
        OSError: ``fd`` is not an open descriptor.
    """
    os.fstat(fd)  # a bad descriptor fails here, in the caller, with a clear error

    def wait_for_end() -> None:
        try:
            while os.read(fd, 4096):
                pass  # the parent never writes; data would only mean a confused caller
        except OSError:
            pass
        finally:
            os.close(fd)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s + 1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # still here: the second signal ends the drain

    thread = threading.Thread(target=wait_for_end, name="evald-parent-watch", daemon=True)
    thread.start()
    return thread
