"""Faults the daemon must survive, each against the run's own daemon: kill -9 under load
(:mod:`.kill9`: calls fail typed and in time, clients recover, modules persist) and a full disk
under the module store (:mod:`.disk_full`: refused registrations leave nothing behind).
"""

from __future__ import annotations

from evald_lab.fuzz.faults.disk_full import disk_full
from evald_lab.fuzz.faults.kill9 import kill_under_load

__all__ = ["disk_full", "kill_under_load"]
