"""A real PostgreSQL server for tests and benchmarks, started from the machine's binaries.

The fleet store's tests (and ``evald bench control-plane``) need a real server they can stop
and start again; a mock would test nothing that matters (locks, snapshots, ``NOTIFY``, roles).
:func:`start_postgres` makes a fresh cluster with ``initdb`` in a temporary folder, as a
non-root user (``initdb`` refuses root: as root it runs as the ``postgres`` user Debian's
package creates), and runs ``postgres`` as a child process on ``127.0.0.1`` with password
authentication, tuned for tests (no fsync). The server dies with the process that started it.

Where the binaries are: ``$EVALD_PG_BINDIR``, else the folder of ``initdb`` on ``PATH``, else
the newest ``/usr/lib/postgresql/*/bin`` (Debian's ``postgresql`` package).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evald.daemon import StoreSettings, child_start

__all__ = ["PostgresServer", "postgres_bindir", "start_postgres"]

ADMIN = "evald_admin"
_START_TIMEOUT_S = 60.0
#: How long the harness's own connections (setting a store up, the operator) wait for a backend.
#: A machine busy with other work forks and initialises one slowly (the first connection to a
#: new database builds its catalog caches); the store's 3 s default is for daemons, which retry.
CONNECT_TIMEOUT_S = 30.0


def postgres_bindir() -> Path | None:
    """The folder of ``initdb`` and ``postgres`` (None: PostgreSQL is not installed)."""
    configured = os.environ.get("EVALD_PG_BINDIR", "").strip()
    if configured:
        return Path(configured) if (Path(configured) / "initdb").exists() else None
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda path: int(path.parent.parent.name) if path.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class PostgresServer:
    """One test cluster: ``admin_url`` reaches it as its superuser (password ``password``)."""

    bindir: Path
    root: Path
    port: int
    password: str
    user: str | None  # who runs the server (None: this process's user)
    process: subprocess.Popen[bytes] | None = None
    logins: dict[str, str] = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def url(self, user: str = ADMIN, database: str = "postgres") -> str:
        """A ``postgresql://`` URL for ``user`` (no password: it goes apart)."""
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def store_settings(self, user: str = ADMIN, database: str = "postgres") -> StoreSettings:
        """Settings for the harness's own connections as ``user``: its password file, and
        :data:`CONNECT_TIMEOUT_S` (not for a daemon under test, whose timeout is the test's)."""
        return StoreSettings(
            url=self.url(user, database),
            password_file=str(self.password_file(user)),
            connect_timeout_s=CONNECT_TIMEOUT_S,
        )

    @property
    def admin_url(self) -> str:
        return self.url()

    def password_file(self, user: str = ADMIN) -> Path:
        """A file holding ``user``'s password (as an operator would keep it)."""
        path = self.root / f"{user}.password"
        path.write_text((self.password if user == ADMIN else self.logins[user]) + "\n")
        path.chmod(0o600)
        return path

    def _ids(self) -> tuple[int, int] | None:
        """(uid, gid) the server runs as (None: this process's)."""
        if self.user is None:
            return None
        entry = pwd.getpwnam(self.user)
        return entry.pw_uid, entry.pw_gid

    def start(self) -> None:
        """Starts (or starts again) the server and waits until it takes connections."""
        if self.running():
            return
        # SIGQUIT: an immediate shutdown when the starter dies, however it dies. Started through
        # child_start: the process starting it may hold gRPC, and must not fork (evald.daemon).
        start = child_start(
            [
                str(self.bindir / "postgres"),
                "-D",
                str(self.data_dir),
                "-p",
                str(self.port),
                "-k",
                str(self.root),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=100",
            ],
            death_signal=signal.SIGQUIT,
            user=self._ids(),
        )
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                start.argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=start.preexec_fn
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        import psycopg

        give_up = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"postgres exited with {self.process.returncode}:\n"
                    + self.log_path.read_text(errors="replace")[-4000:]
                )
            try:
                with psycopg.connect(self.admin_url, password=self.password, connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > give_up:
                    raise RuntimeError(
                        "postgres did not take connections:\n"
                        + self.log_path.read_text(errors="replace")[-4000:]
                    ) from None
                time.sleep(0.05)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, immediate: bool = False) -> None:
        """Stops the server (a fast shutdown: open connections are ended; ``immediate``:
        as on a crash). The data stays for :meth:`start`."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGQUIT if immediate else signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        """Stops the server and removes its folder."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def execute(
        self, statement: Any, params: tuple[object, ...] = (), *, database: str = "postgres"
    ) -> list[tuple[Any, ...]]:
        """Runs one statement (a string or a ``psycopg.sql`` composition) as the superuser;
        returns its rows (none for a command)."""
        import psycopg

        query = statement.encode() if isinstance(statement, str) else statement
        with psycopg.connect(
            self.url(database=database), password=self.password, autocommit=True
        ) as conn:
            cursor = conn.execute(query, params or None)
            return list(cursor.fetchall()) if cursor.description else []

    def create_database(self, name: str) -> None:
        from psycopg import sql

        self.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def create_login(self, name: str, member_of: str) -> str:
        """A login role in group ``member_of`` with a fresh password (returned, and kept for
        :meth:`password_file`)."""
        from psycopg import sql

        password = f"pw-{name}-{os.urandom(6).hex()}"
        self.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(name), sql.Literal(password), sql.Identifier(member_of)
            )
        )
        self.logins[name] = password
        return password


def start_postgres(root: Path | None = None) -> PostgresServer:
    """A fresh, running PostgreSQL cluster (see the module).

    Parameters:
        root: where its folder goes (default: a new temporary folder; as root, one the
            ``postgres`` user can reach).

    Raises:
        RuntimeError: PostgreSQL is not installed, or the cluster did not start (the message
            carries its log).
    """
    bindir = postgres_bindir()
    if bindir is None:
        raise RuntimeError(
            "PostgreSQL is not installed (apt-get install postgresql; or set EVALD_PG_BINDIR)"
        )
    user: str | None = None
    if os.geteuid() == 0:
        user = "postgres"
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise RuntimeError("initdb refuses root and there is no postgres user") from None
    folder = Path(tempfile.mkdtemp(prefix="evald-pg-", dir=root))
    password = f"admin-{os.urandom(8).hex()}"
    server = PostgresServer(bindir, folder, _free_port(), password, user)
    pwfile = folder / "initdb.pw"
    pwfile.write_text(password + "\n")
    if user is not None:
        entry = pwd.getpwnam(user)
        for path in (folder, pwfile):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        folder.chmod(0o700)
    try:
        initdb = child_start(
            [
                str(bindir / "initdb"),
                "-D",
                str(server.data_dir),
                "-U",
                ADMIN,
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            user=server._ids(),
        )
        subprocess.run(
            initdb.argv,
            check=True,
            capture_output=True,
            timeout=120,
            preexec_fn=initdb.preexec_fn,
        )
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{exc.stderr.decode(errors='replace')}") from None
    finally:
        with contextlib.suppress(OSError):
            pwfile.unlink()
    try:
        server.start()
    except BaseException:
        server.close()
        raise
    return server
