"""The daemon a run attacks: one it starts for itself, or an existing one (``--target``).

Its own daemon runs in a fresh folder (socket, state, logs) with the fuzz config's two tenants and
fresh tokens; the run may kill it with SIGKILL, restart it on the same state folder, and stops it
with SIGTERM at the end, when it must exit 0. An existing daemon is only reached: its config file
gives the limits the checks hold it to, and its pid (when given) its RSS.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from evald.daemon import Config, load_config, parse_config
from evald.testing import DaemonProcess, free_port, process_rss_bytes, start_daemon
from evald_lab.fuzz.checks import Violation
from evald_lab.fuzz.settings import FuzzSettings, fuzz_config
from evald_lab.fuzz.tally import Recorder

__all__ = ["DaemonUnderTest", "reach_daemon"]


@dataclass
class DaemonUnderTest:
    """How to reach the daemon as each tenant, and, for the run's own daemon, its process.

    Attributes:
        config: the daemon's config (limits, message sizes, the data path).
        target: its gRPC address.
        tokens: the bearer token of each tenant the run uses.
        victim, attacker: the two tenants' names.
        threads: its worker threads (an existing daemon's: ``--threads``).
        metrics_port: its Prometheus port (the run's own daemon only).
        process: the run's own daemon (replaced by :meth:`restart`); None for ``--target``.
        root: the own daemon's folder (removed at the end unless ``--keep``).
        config_text: the own daemon's config file, for restarts.
        target_pid: an existing daemon's pid (``--target-pid``), for RSS and liveness.
    """

    config: Config
    target: str
    tokens: dict[str, str]
    victim: str
    attacker: str
    threads: int
    metrics_port: int | None = None
    process: DaemonProcess | None = None
    root: Path | None = None
    config_text: str = ""
    target_pid: int | None = None

    def pid(self) -> int | None:
        """The daemon's current pid (it changes on a restart), None when unknown."""
        if self.process is not None:
            return self.process.pid
        return self.target_pid

    def alive(self) -> bool:
        """Whether the process lives; an existing daemon without a pid counts as alive."""
        if self.process is not None:
            return self.process.alive()
        return self.target_pid is None or process_rss_bytes(self.target_pid) is not None

    def kill(self) -> None:
        """SIGKILL (the kill -9 fault)."""
        assert self.process is not None
        self.process.kill()

    def restart(self) -> None:
        """Starts it again on the same socket and state folder (after :meth:`kill`)."""
        assert self.process is not None and self.root is not None
        self.process = start_daemon(
            self.root,
            self.config_text,
            socket_path=self.process.socket_path,
            state_dir=self.process.state_dir,
        )

    def stop(self, recorder: Recorder) -> int | None:
        """SIGTERM to the run's own daemon, when it still runs; any exit status but 0 is a crash.

        Returns:
            The exit status, None when there was nothing to stop.
        """
        if self.process is None or not self.process.alive():
            return None
        exit_status = self.process.stop(signal.SIGTERM, timeout_s=60)
        if exit_status != 0:
            recorder.add(
                [Violation("crash", "daemon", f"the daemon exited {exit_status} on SIGTERM")]
            )
        return exit_status

    def remove_folder(self, settings: FuzzSettings) -> None:
        """Removes the own daemon's folder, unless ``--keep`` asked to keep it (its logs)."""
        if self.root is not None and not settings.extra.get("keep"):
            shutil.rmtree(self.root, ignore_errors=True)


def reach_daemon(settings: FuzzSettings) -> DaemonUnderTest:
    """The run's own daemon, started, or the ``--target`` one.

    Raises:
        ValueError: ``--target`` without ``--target-config``.
        RuntimeError: the own daemon did not start (the message carries its log).
    """
    if settings.target is None:
        return _start_own_daemon(settings)
    if settings.target_config is None:
        raise ValueError("--target needs --target-config (the daemon's config file)")
    return DaemonUnderTest(
        config=load_config(settings.target_config),
        target=settings.target,
        tokens={settings.victim: settings.victim_token, settings.attacker: settings.attacker_token},
        victim=settings.victim,
        attacker=settings.attacker,
        threads=max(1, settings.threads),
        target_pid=settings.target_pid,
    )


def _start_own_daemon(settings: FuzzSettings) -> DaemonUnderTest:
    root = Path(tempfile.mkdtemp(prefix="evald-fuzz-", dir=settings.work_dir))
    tokens = {"victim": secrets.token_urlsafe(24), "attacker": secrets.token_urlsafe(24)}
    metrics_port = free_port()
    config_text = fuzz_config(
        victim_token=tokens["victim"],
        attacker_token=tokens["attacker"],
        threads=settings.threads,
        metrics_port=metrics_port,
        data_listen=f"unix:{root / 'data.sock'}",
    )
    config = parse_config(config_text, "<fuzz config>")
    try:
        process: DaemonProcess = start_daemon(root, config_text, socket_path=root / "d.sock")
    except BaseException:
        if not settings.extra.get("keep"):
            shutil.rmtree(root, ignore_errors=True)
        raise
    return DaemonUnderTest(
        config=config,
        target=process.target,
        tokens=tokens,
        victim="victim",
        attacker="attacker",
        threads=config.server.resolved_threads,
        metrics_port=metrics_port,
        process=process,
        root=root,
        config_text=config_text,
    )
