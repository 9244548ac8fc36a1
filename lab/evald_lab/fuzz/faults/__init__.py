"""Faults the daemon must survive, each against the run's own daemon: kill -9 under load
(:mod:`.kill9`: calls fail typed and in time, clients recover, modules persist, no child
outlives the daemon), a full disk under the module store (:mod:`.disk_full`: refused
registrations leave nothing behind), modules deleted and replaced again and again
(:mod:`.module_memory`: their memory comes back), SIGTERM while registrations compile and an
index edited by hand (:mod:`.restarts`).
"""

from __future__ import annotations

from evald_lab.fuzz.faults.disk_full import disk_full
from evald_lab.fuzz.faults.kill9 import kill_under_load
from evald_lab.fuzz.faults.module_memory import deleted_module_memory
from evald_lab.fuzz.faults.restarts import sigterm_while_compiling, state_folder_at_load

__all__ = [
    "deleted_module_memory",
    "disk_full",
    "kill_under_load",
    "sigterm_while_compiling",
    "state_folder_at_load",
]
