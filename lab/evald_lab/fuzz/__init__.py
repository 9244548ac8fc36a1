"""``evald fuzz``: a security fuzzer that drives a real daemon over its unix socket.

Modules, one concern each: :mod:`.corpus` (attack inputs per evaluator), :mod:`.generate`
(grammar-aware generation and mutation), :mod:`.modules` (malicious WAT modules),
:mod:`.protocol` (gRPC abuse), :mod:`.noisy` (noisy neighbour), :mod:`.faults` (kill -9, full
disk), :mod:`.checks` (the invariants), :mod:`.report` (JSON, summary, plot), :mod:`.runner`
(one run, start to end) and :mod:`.settings` (profiles, the fuzz daemon's config).
"""

from __future__ import annotations

from evald_lab.fuzz.report import summary_markdown, write_report
from evald_lab.fuzz.runner import run_fuzz
from evald_lab.fuzz.settings import FULL, PROFILES, SHORT, FuzzSettings, Profile

__all__ = [
    "FULL",
    "PROFILES",
    "SHORT",
    "FuzzSettings",
    "Profile",
    "run_fuzz",
    "summary_markdown",
    "write_report",
]
