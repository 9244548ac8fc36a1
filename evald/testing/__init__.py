"""A real evald for tests: the daemon as a child process, and ABI modules that misbehave on demand.

For whoever tests something against evald — evald's own tests, the engine adapters' real-server
tests, ``evald fuzz`` and the benchmarks, an operator's integration tests of their engine:

* :func:`start_daemon` runs ``evald serve`` with a given config on a private unix socket, waits
  until it is healthy and returns a :class:`DaemonProcess` (its log, RSS, stop, kill -9); the
  daemon dies with the process that started it, however that process dies.
* :func:`guest` builds an ABI v1 module from a behaviour (``echo``, ``loop``, ``burn``,
  ``grow``, ``recurse``, …) with wasmtime's WAT compiler, no Zig needed; :func:`arg` passes its
  size parameter, :func:`manifest_bytes` writes its manifest (:func:`named_guest`: one to
  register under a name), :func:`padded` pads a module to an exact size;
* :func:`tenant_table` writes a config's ``[[tenants]]`` table, its token hashed;
* :func:`cpu_hogs` keeps the CPUs busy for a block (a loaded machine, for bounds that must
  hold there too);
* :func:`start_postgres` runs a real PostgreSQL from the machine's binaries (a fresh cluster
  in a temporary folder) for the fleet store's tests and benchmarks.

Everything runs the real thing: the ``evald`` console script, a real socket, real wasmtime.
Nothing here is imported by the daemon; the lab (``evald_lab``) and the tests import it.
"""

from __future__ import annotations

from evald.testing._churn import HelloChurn
from evald.testing._config import tenant_table
from evald.testing._daemon import (
    EVALD,
    START_TIMEOUT_S,
    DaemonProcess,
    evald_command,
    free_port,
    padded,
    process_alive,
    process_cpu_s,
    process_descendants,
    process_rss_bytes,
    start_daemon,
    wait_serving,
)
from evald.testing._hogs import cpu_hogs
from evald.testing._postgres import PostgresServer, postgres_bindir, start_postgres
from evald.testing._wat_modules import (
    IN_PTR,
    MANIFEST,
    PAGE,
    REMEMBER_HEAP,
    REMEMBERED_NOTHING,
    arg,
    branchy_function,
    guest,
    manifest_bytes,
    named_guest,
    remembered,
    wat_text,
)

__all__ = [
    "EVALD",
    "IN_PTR",
    "MANIFEST",
    "PAGE",
    "REMEMBERED_NOTHING",
    "REMEMBER_HEAP",
    "START_TIMEOUT_S",
    "DaemonProcess",
    "HelloChurn",
    "PostgresServer",
    "arg",
    "branchy_function",
    "cpu_hogs",
    "evald_command",
    "free_port",
    "guest",
    "manifest_bytes",
    "named_guest",
    "padded",
    "postgres_bindir",
    "process_alive",
    "process_cpu_s",
    "process_descendants",
    "process_rss_bytes",
    "remembered",
    "start_daemon",
    "start_postgres",
    "tenant_table",
    "wait_serving",
    "wat_text",
]
