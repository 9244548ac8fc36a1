"""A token-less peer churning data-path connections, in a process of its own.

Each connection sends the first byte of a HELLO and is closed 0.2 s later, about 400 a second,
so every one of them is younger than the daemon's HELLO grace while it is open: the attack that
once had 33 of 40 real connections refused (docs/data-path.md). A process of its own, because
the daemon accounts its unauthenticated slots per peer process: a flood from the client's own
process would be the client's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

__all__ = ["HelloChurn"]

_SCRIPT = """
import signal, socket, sys, time
path = sys.argv[1]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
held = []
opened = 0
while not stop:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.send(b"\\\\x00")
        opened += 1
    except OSError:
        pass
    held.append((time.monotonic(), sock))
    while held and time.monotonic() - held[0][0] >= 0.2:
        held.pop(0)[1].close()
    time.sleep(0.0025)
for _, sock in held:
    sock.close()
print(opened, flush=True)
"""


class HelloChurn:
    """The churning peer against the data socket at ``path``, from ``start`` until ``stop``."""

    def __init__(self, path: Path | str) -> None:
        self._path = str(path)
        self._process: subprocess.Popen[str] | None = None
        self.opened = 0

    def start(self) -> HelloChurn:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, self._path], stdout=subprocess.PIPE, text=True
        )
        return self

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> int:
        """Ends the peer; returns how many connections it opened (also :attr:`opened`)."""
        process, self._process = self._process, None
        if process is None:
            return self.opened
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        self.opened = int(out) if out.strip().isdigit() else 0
        return self.opened

    def __enter__(self) -> HelloChurn:
        return self.start()

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        self.stop()
