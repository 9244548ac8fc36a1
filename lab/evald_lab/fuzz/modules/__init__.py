"""Malicious modules (WAT): what an attacker tenant uploads, and what must happen to each.

Two tables, per issue 6: :mod:`.refused` (modules the daemon must **refuse at registration**)
and :mod:`.accepted` (modules that **register and then misbehave on every call**, each row
saying which outcomes a call may have). :mod:`.build` holds what a row is and the builders the
tables are written in; :mod:`.mutation` breaks module bytes for registration fuzzing.
"""

from __future__ import annotations

from evald_lab.fuzz.modules.accepted import accepted_modules
from evald_lab.fuzz.modules.build import MaliciousModule
from evald_lab.fuzz.modules.mutation import mutated_module
from evald_lab.fuzz.modules.refused import refused_modules

__all__ = ["MaliciousModule", "accepted_modules", "mutated_module", "refused_modules"]
