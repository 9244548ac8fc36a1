"""Starts the real SGLang 0.5.23 HTTP server on the CPU with the evald adapter, for the adapter's
real-server tests and the lab's SGLang benchmarks.

The caller runs in the project's venv; the server runs in ``.venv-sglang`` (``make sglang-venv``:
SGLang, its CPU kernel built from ``deploy/sglang-cpu/``, and this repository installed
editable), launched as a user launches it: ``python -m sglang.launch_server`` with ``EVALD_*``
in its environment, SGLang loading the adapter through its ``sglang.srt.plugins`` entry point.
:data:`CONFIG` is the daemon config those runs share (its tenants' tokens are :data:`TOKEN`,
:data:`OTHER_TOKEN`, :data:`SPIN_TOKEN` and
:data:`SLOW_TOKEN`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_adapter.testing._common import free_port, has_amx, model_folder, post
from engine_adapter.testing._server_runs import (
    SLOW_TENANT_DEADLINE_MS,
    SPAN_DEADLINE_MS,
    SPIN_TENANT_DEADLINE_MS,
    CpuPartition,
    adapter_checkout,
    daemon_config,
    metric_lines,
    rank_cpu_lists,
    stop_process,
    stream_chunks,
    tenant,
    venv_python,
    wait_healthy,
)
from evald.daemon import child_start

__all__ = [
    "CONFIG",
    "DEADLINE_MS",
    "OTHER_TOKEN",
    "SCHEDULERS",
    "SLOW_TENANT_DEADLINE_MS",
    "SLOW_TOKEN",
    "SPIN_TOKEN",
    "TOKEN",
    "SglangServer",
    "sglang_python",
    "start_server",
    "unsupported_reason",
]

#: Tokens of the test daemon's tenants (its config holds only their hashes).
TOKEN = "sglang-server-token-0123456789abcdef"
OTHER_TOKEN = "sglang-other-token-0123456789abcdef"
SPIN_TOKEN = "sglang-spin-token-0123456789abcdef"
SLOW_TOKEN = "sglang-slow-token-0123456789abcdef"
CONFIG = daemon_config(
    tenant("sglang", TOKEN, allow_register=True),
    tenant("other", OTHER_TOKEN),
    tenant("spin", SPIN_TOKEN, allow_register=True, deadline_ms=SPIN_TENANT_DEADLINE_MS),
    tenant("slow", SLOW_TOKEN, allow_register=True, deadline_ms=SLOW_TENANT_DEADLINE_MS),
)

#: The adapter's per-span deadline on the test servers (a hung evald costs a span this long).
DEADLINE_MS = SPAN_DEADLINE_MS
READY_TIMEOUT_S = 400.0
#: SGLang's two schedulers: ``normal`` is ``--disable-overlap-schedule``; ``overlap`` is
#: SGLang's default (the next step is launched before the last one's tokens are processed).
SCHEDULERS = ("normal", "overlap")
SERVED_MODEL = "smollm2"
#: SGLang's KV cache in tokens (32 requests of 512): SGLang sizes its cache from the memory left
#: once its weights are loaded, and cannot when its OpenMP threads are bound (no NUMA node's
#: memory to go by); capped here, it is the same on every machine.
MAX_TOTAL_TOKENS = 16384
#: SGLang's share of the machine's free memory, which it checks against what is left once the
#: weights are loaded: memory other processes take meanwhile counts as its own, and on a shared
#: 23 GB machine 0.05 and 0.1 both left "no memory for the KV cache" while another process
#: loaded a model. The cache itself is MAX_TOTAL_TOKENS.
MEM_FRACTION_STATIC = "0.3"


def sglang_python(root: Path | None = None) -> Path | None:
    """``$EVALD_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` in the checkout ``root``
    (default: the current folder), if present."""
    return venv_python("EVALD_SGLANG_PYTHON", ".venv-sglang", root)


def unsupported_reason(root: Path | None = None) -> str | None:
    """Why ``make sglang-venv`` did not build the venv on this CPU (its own words), if so."""
    marker = (root if root is not None else Path.cwd()) / ".venv-sglang" / ".unsupported"
    with contextlib.suppress(OSError):
        return marker.read_text().strip() or None
    return None


@dataclass
class SglangServer:
    """A running ``sglang.launch_server`` process."""

    process: subprocess.Popen[bytes]
    port: int
    scheduler: str
    log_path: Path
    tp_size: int = 1

    @property
    def name(self) -> str:
        """The scheduler, and the tensor-parallel size when above one (``overlap-tp2``)."""
        return self.scheduler if self.tp_size == 1 else f"{self.scheduler}-tp{self.tp_size}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return SERVED_MODEL

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(self, text: str, timeout_s: float = 300.0, **sampling: Any) -> dict[str, Any]:
        """``POST /generate`` (greedy unless told); ``sampling`` are its sampling params, with
        ``custom_params``, ``structural_tag`` and ``json_schema`` (dicts, sent as JSON text)
        among them."""
        params = {"temperature": 0, **sampling}
        for key in ("structural_tag", "json_schema"):
            if isinstance(params.get(key), Mapping):
                params[key] = json.dumps(params[key])
        return post(f"{self.url}/generate", {"text": text, "sampling_params": params}, timeout_s)

    def stream(
        self, text: str, timeout_s: float = 300.0, **sampling: Any
    ) -> tuple[str, list[float]]:
        """A streamed ``/generate``: the text and the arrival time of each chunk that grew it."""
        params = {"temperature": 0, **sampling}
        if isinstance(params.get("structural_tag"), Mapping):
            params["structural_tag"] = json.dumps(params["structural_tag"])
        payload = {"text": text, "sampling_params": params, "stream": True}
        last, times = "", []
        for chunk, arrived in stream_chunks(f"{self.url}/generate", payload, timeout_s):
            current = chunk.get("text", "")
            if len(current) > len(last):
                times.append(arrived)
                last = current
        return last, times

    def stream_texts(self, text: str, timeout_s: float = 300.0, **sampling: Any) -> list[str]:
        """A streamed ``/generate``: the text as each chunk left it, in order (the last is the
        final text). ``json_schema`` may be a dict (sent as JSON text)."""
        params = {"temperature": 0, **sampling}
        for key in ("structural_tag", "json_schema"):
            if isinstance(params.get(key), Mapping):
                params[key] = json.dumps(params[key])
        payload = {"text": text, "sampling_params": params, "stream": True}
        return [
            chunk.get("text", "")
            for chunk, _ in stream_chunks(f"{self.url}/generate", payload, timeout_s)
        ]

    def chat(
        self, messages: Sequence[Mapping[str, str]], timeout_s: float = 300.0, **body: Any
    ) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (greedy unless told)."""
        payload = {"model": SERVED_MODEL, "messages": list(messages), "temperature": 0, **body}
        return post(f"{self.url}/v1/chat/completions", payload, timeout_s)

    def abort(self, rid: str) -> None:
        """``POST /abort_request`` for the request whose ``rid`` this is."""
        request = urllib.request.Request(
            f"{self.url}/abort_request",
            data=json.dumps({"rid": rid}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def metrics(self) -> dict[str, float]:
        """SGLang's Prometheus counters and gauges, by name and labels (one line each)."""
        values: dict[str, float] = {}
        for name, value in metric_lines(self.url):
            with contextlib.suppress(ValueError):
                values[name] = float(value)
        return values

    def forward_passes(self) -> dict[str, float]:
        """The server's own count of forward passes, by kind (``prefill``, ``decode``): rank
        0's (with tensor parallelism every rank runs each forward and counts it)."""
        counts = {"prefill": 0.0, "decode": 0.0}
        for name, value in self.metrics().items():
            if name.startswith("sglang:cuda_graph_passes_total{") and (
                "tp_rank=" not in name or 'tp_rank="0"' in name
            ):
                kind = "prefill" if 'mode="prefill' in name else "decode"
                counts[kind] += value
        return counts

    def stop(self) -> None:
        """SIGTERM (SGLang's launcher takes its scheduler and detokenizer along), then whatever
        is left of the process group is killed."""
        stop_process(self.process, signal.SIGTERM, 60, group=True)


def start_server(
    python: Path,
    env: Mapping[str, str],
    log_path: Path,
    *,
    scheduler: str = "normal",
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    partition: CpuPartition | None = None,
    tp_size: int = 1,
) -> SglangServer:
    """Starts the server with ``env`` added to this environment and waits for ``/health``.

    ``--sleep-on-idle``: an idle SGLang scheduler otherwise spins a whole core, which on a small
    machine takes the CPU the tests and evald need. The dtype is float32 without AMX (SGLang's
    torch_native path; texts then compare across batch sizes) and bfloat16 with it (the CPU
    kernel has no fp32 paths). ``prefix`` runs the server under another command.
    ``partition``: the server runs on the engine's CPUs (``taskset``) with its OpenMP threads
    bound to them (``SGLANG_CPU_OMP_THREADS_BIND``); evald's daemon takes the others.
    ``tp_size``: SGLang's ``--tp-size``, each rank's OpenMP threads bound to its own share of
    this process's CPUs (:func:`~engine_adapter.testing.rank_cpu_lists`), as SGLang's CPU
    backend asks.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler {scheduler!r}: expected one of {SCHEDULERS}")
    if tp_size > 1 and partition is not None:
        raise ValueError("a partitioned server runs one rank (tp_size 1)")
    folder = model_folder()
    port = free_port()
    command = [
        *prefix, str(python), "-m", "sglang.launch_server",
        "--model-path", str(folder), "--served-model-name", SERVED_MODEL,
        "--device", "cpu", "--grammar-backend", "xgrammar", "--tp-size", str(tp_size),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16" if has_amx() else "float32",
        "--mem-fraction-static", MEM_FRACTION_STATIC, "--max-running-requests", "32",
        "--sleep-on-idle", "--enable-metrics",
        *(["--disable-overlap-schedule"] if scheduler == "normal" else []),
        "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        *extra_args,
    ]  # fmt: skip
    if partition is not None:
        command[:0] = partition.engine_prefix()
        env = {**partition.engine_env("SGLANG_CPU_OMP_THREADS_BIND"), **env}
    if tp_size > 1:
        env = {"SGLANG_CPU_OMP_THREADS_BIND": rank_cpu_lists(tp_size), **env}
    environ = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **env,
    }
    environ["PYTHONPATH"] = adapter_checkout()  # the adapter under test, not the venv's copy
    log = open(log_path, "wb")  # owned by the server process for its lifetime
    # A test run killed with -9 takes the server along (the parent-death signal), and the test
    # process, which holds gRPC channels, starts it without forking (evald.daemon.child_start).
    start = child_start(command, death_signal=signal.SIGTERM)
    process = subprocess.Popen(
        start.argv,
        env=environ,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(log_path.parent),
        start_new_session=True,  # its own group, so stop() reaches every SGLang process
        preexec_fn=start.preexec_fn,
    )
    server = SglangServer(process, port, scheduler, log_path, tp_size)
    wait_healthy(process, server.url, "SGLang", server.log, server.stop, READY_TIMEOUT_S)
    return server
