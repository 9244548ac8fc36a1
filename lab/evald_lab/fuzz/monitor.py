"""The watch kept on the daemon all run long: its RSS and its health service, twice a second.

A crash or a hang can happen between two checked responses (a worker that never returns, a
process the kernel killed for memory); the monitor notices it even when no step is waiting on the
daemon, and a crash stops the run. It is paused while the kill -9 fault takes the daemon down on
purpose.
"""

from __future__ import annotations

import threading

from evald.client import CallError, Client
from evald.testing import process_rss_bytes
from evald_lab.fuzz.checks import Checker, Violation
from evald_lab.fuzz.daemon_under_test import DaemonUnderTest
from evald_lab.fuzz.tally import Recorder

__all__ = ["DaemonMonitor"]


class DaemonMonitor(threading.Thread):
    """Samples the daemon's RSS and asks its health service, every ``period_s``.

    ``stop`` is the run's stop event: set when the daemon is gone. ``paused``: set while the
    daemon is down on purpose; ``done``: set to end the thread.
    """

    def __init__(
        self,
        daemon: DaemonUnderTest,
        recorder: Recorder,
        stop: threading.Event,
        *,
        rss_bound_bytes: int,
        period_s: float = 0.5,
    ) -> None:
        super().__init__(name="fuzz-monitor", daemon=True)
        self.daemon_under_test = daemon  # not ``daemon``: that is the thread's daemon flag
        self.recorder = recorder
        self.stop = stop
        self.rss_bound_bytes = rss_bound_bytes
        self.period_s = period_s
        self.paused = threading.Event()
        self.done = threading.Event()
        self.peak_rss = 0
        self.samples = 0
        self.health_checks = 0
        self.crashed = False

    def run(self) -> None:
        client: Client | None = None
        try:
            while not self.done.wait(self.period_s):
                if self.paused.is_set():
                    if client is not None:
                        client.close()
                        client = None
                    continue
                self.sample()
                if client is None:
                    client = Client(self.daemon_under_test.target, timeout_s=5.0)
                self.check_health(client)
        finally:
            if client is not None:
                client.close()

    def sample(self) -> None:
        pid = self.daemon_under_test.pid()
        if pid is None:
            return
        rss = process_rss_bytes(pid)
        if rss is None:
            if not self.paused.is_set() and not self.crashed:
                self.crashed = True
                self.recorder.add([Violation("crash", "daemon", "the daemon process is gone")])
                self.stop.set()
            return
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.recorder.add(Checker.rss(rss, self.rss_bound_bytes))

    def check_health(self, client: Client) -> None:
        try:
            status = client.health()
        except CallError as error:
            if self.paused.is_set():
                return
            alive = self.daemon_under_test.alive()
            kind = "hang" if alive else "crash"
            self.recorder.add([Violation(kind, "daemon", f"health check failed: {error}")])
            if not alive:
                self.crashed = True
                self.stop.set()
            return
        self.health_checks += 1
        if status != "SERVING" and not self.paused.is_set():
            self.recorder.add([Violation("hang", "daemon", f"health says {status}")])
