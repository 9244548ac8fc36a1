"""``evald fuzz``: a security fuzzer that drives a real daemon over its unix socket.

Modules, one concern each. What is sent: :mod:`.corpus` (attack inputs per evaluator),
:mod:`.generate` (grammar-aware generation and mutation), :mod:`.modules` (malicious WAT modules,
as tables), :mod:`.protocol` (gRPC and data-path abuse, a module per theme), :mod:`.noisy`
(noisy neighbour), :mod:`.faults` (kill -9, full disk; a module each). How it is sent and judged:
:mod:`.context` (the shared state; every evaluation goes through its ``send``), :mod:`.sending`
(batches and streams), :mod:`.settling` (checks, tally, repeats of over-bound times),
:mod:`.checks` (the invariants), :mod:`.tally` (what each class sent and got back),
:mod:`.registration` (what each registration must come to).
The run: :mod:`.runner` (start to end), :mod:`.daemon_under_test` (its own daemon or
``--target``), :mod:`.preparation` (the set-up), :mod:`.monitor` (RSS and health all along),
:mod:`.phases` (around the main loop), :mod:`.main_loop` and :mod:`.budget` (lanes, the class
mix), :mod:`.steps` (one module per class), :mod:`.narration` (console and progress bar).
The result: :mod:`.report_json` (what the report holds), :mod:`.report` (JSON, summary, plot),
:mod:`.hardening` (what fuzzing found). :mod:`.settings`: profiles, the fuzz daemon's config.
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
