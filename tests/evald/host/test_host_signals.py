"""The host keeps working when another library replaces the SIGSEGV handler.

``tvm_ffi`` (imported by XGrammar) installs its own SIGSEGV handler without chaining to
wasmtime's; with signal-based traps an out-of-bounds guest access then kills the process. The
host therefore compiles explicit bounds checks by default. Each case runs in a subprocess that
resets SIGSEGV to its default action after the host started, the harshest form of that
replacement.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import ctypes, signal, sys
sys.path.insert(0, {helpers!r})
from evald.testing import guest
from evald.host import HostConfig, Limits, WasmHost
host = WasmHost(HostConfig(signals_based_traps={signals}))
module = host.load(guest("oob"))
ctypes.CDLL(None).signal(signal.SIGSEGV, 0)  # SIG_DFL, as a foreign handler would leave it
ctypes.CDLL(None).signal(signal.SIGBUS, 0)
outcome = host.evaluate(module, b"", Limits())
print(outcome.error.value, flush=True)
"""


def run(signals: bool) -> subprocess.CompletedProcess[str]:
    helpers = str(Path(__file__).resolve().parents[1])
    code = SCRIPT.format(helpers=helpers, signals=signals)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_explicit_bounds_checks_survive_a_replaced_handler() -> None:
    result = run(signals=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "guest_fault"


@pytest.mark.skipif(sys.platform != "linux", reason="signal numbers checked on Linux")
def test_signal_based_traps_do_not() -> None:
    # the reason for the default: the same guest kills a host that relies on the handler
    result = run(signals=True)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stdout)
