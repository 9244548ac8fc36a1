"""``evald bench overhead``: what one evaluation costs on each path, side by side in one run.

Paths, all on the same inputs (calc and strop, a short and a long input each):

* ``python`` — the Python reference implementation called in this process (the baseline);
* ``wasm-reuse`` — :class:`~evald.WasmHost` in this process, reused instance (the fast path);
* ``wasm-fresh`` — the same host with ``isolation = "fresh"`` (the default): every call starts
  from a new instance's state (the kept instance put back after each call);
* ``evald`` — the daemon (``evald serve``, started here) over its unix socket and over loopback
  TCP, each as unary ``Evaluate``, ``EvaluateBatch`` with 1, 8 or 64 items per message, and
  ``EvaluateStream`` with 1, 8 or 64 items per message; and over its data path (transport
  ``data``: the stream's messages as length-prefixed frames on a unix socket of their own,
  ``[server] data_listen``) with 1, 8 or 64 items per message;
* ``raw-uds`` — the floor under any of these: the same frames and messages to a process that
  answers without evaluating (:mod:`evald_lab.bench._raw_floor`), so the data path is judged as a
  multiple of what a process boundary costs here, measured in the same rounds.

Each path runs at concurrency 1, 8 and 64: that many closed-loop callers (threads in process
and on the data path and raw floor, each with a connection of its own; coroutines on one
``grpc.aio`` channel for gRPC), each issuing its next call as soon as the previous one
returns. A call's latency is the time from issuing it until its result (for a
message of k items, every item's latency is that message's round trip). Throughput counts items.
CPU time per evaluation (this process plus the daemon, from ``/proc``) is reported too: on a
shared machine it is steadier than wall time, and ``cores / cpu_per_eval`` is what the machine
could do alone.

Every configuration runs for a short slice, in round-robin order, several rounds: a burst of
load from elsewhere hits all configurations alike. Each row is also given as a ratio to the
``python`` row of the same input and concurrency, and as a fraction of one decode step of the
local engine (SmolLM2-135M on llama.cpp), timed in the same rounds. The decode step is measured
through ``engine_adapter``, imported only when the benchmark runs (``evald`` itself never
depends on it); without it the fractions are left empty.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evald_lab.bench._common import (
    DEFAULT_OUT_DIR,
    SCHEMA_VERSION,
    Progress,
    cpu_seconds_of,
    load_average,
    machine_info,
    summarize_ns,
    write_json,
)

__all__ = [
    "INPUTS",
    "PROFILES",
    "OverheadProfile",
    "bench_daemon_config",
    "run_overhead",
]

#: Benchmark inputs: name -> (evaluator, bytes). Both evaluators give the same value as their
#: Python reference on each (checked before measuring).
INPUTS: dict[str, tuple[str, bytes]] = {
    "calc-short": ("calc", b"17 * 23 + 91"),
    "calc-long": (
        "calc",
        b"((1234567 * 89101) + 4567 * (12 - 345) ** 2) / 7 - (98765 % 4321) * 3.14159 "
        b"+ 2 ** 64 / (17 * 23 + 91) - 1000000007 * (5 - 8) + 0.5 * (6.25 - 0.125)",
    ),
    "strop-short": ("strop", b'count("strawberry", "r")'),
    "strop-long": (
        "strop",
        b'upper(reverse(substr("'
        + b"the quick brown fox jumps over the lazy dog " * 6
        + b'", 4, 200)))',
    ),
}

#: Deadline of every benchmark evaluation (in process and in the daemon), far from the cost.
BENCH_DEADLINE_MS = 10_000
#: The token the ``bench`` tenant uses over TCP (a loopback daemon that lives for one run).
BENCH_TOKEN = "evald-bench-token-0123456789abcdef"
_SERVER_THREADS_DEFAULT = 0  # one guest thread per CPU, as the daemon's default
_GRPC_TRANSPORTS = ("uds", "tcp")
_DATA = "data"


@dataclass(frozen=True)
class OverheadProfile:
    """How much to measure. ``slice_s`` is one configuration's time per round."""

    name: str
    inputs: tuple[str, ...]
    concurrency: tuple[int, ...]
    items_per_message: tuple[int, ...]
    transports: tuple[str, ...]
    rounds: int
    slice_s: float
    decode_steps_per_round: int
    fresh_slice_fraction: float = 1.0

    @property
    def configurations_per_round(self) -> int:
        grpc = [t for t in self.transports if t in _GRPC_TRANSPORTS]
        items = len(self.items_per_message)
        paths = 3 + len(grpc) * (1 + 2 * items)
        if _DATA in self.transports:
            paths += 2 * items  # the data path and its raw floor
        return paths * len(self.concurrency) * len(self.inputs)


PROFILES: dict[str, OverheadProfile] = {
    # A few seconds: every path once, for tests.
    "tiny": OverheadProfile(
        name="tiny",
        inputs=("calc-short", "strop-short"),
        concurrency=(1, 8),
        items_per_message=(1, 8),
        transports=("uds", "tcp", _DATA),
        rounds=1,
        slice_s=0.02,
        decode_steps_per_round=2,
    ),
    # Every path, input and concurrency of the issue: about 4 minutes.
    "full": OverheadProfile(
        name="full",
        inputs=tuple(INPUTS),
        concurrency=(1, 8, 64),
        items_per_message=(1, 8, 64),
        transports=("uds", "tcp", _DATA),
        rounds=3,
        slice_s=0.35,
        decode_steps_per_round=8,
    ),
}


@dataclass(frozen=True)
class _Config:
    path: str  # python | wasm-reuse | wasm-fresh | evald | raw-uds
    input: str
    concurrency: int
    transport: str | None = None  # uds | tcp | data
    rpc: str | None = None  # unary | batch | stream
    items: int = 1

    @property
    def label(self) -> str:
        if self.path == "raw-uds":
            return f"raw-uds x{self.items} c={self.concurrency} {self.input}"
        if self.path != "evald":
            return f"{self.path} c={self.concurrency} {self.input}"
        return f"evald {self.transport} {self.rpc}x{self.items} c={self.concurrency} {self.input}"


@dataclass
class _Tally:
    latencies_ns: list[int] = field(default_factory=list)
    items: int = 0
    wall_s: float = 0.0
    client_cpu_s: float = 0.0
    daemon_cpu_s: float | None = None
    errors: int = 0


@dataclass
class _Slice:
    latencies_ns: list[int]
    items: int
    wall_s: float
    errors: int = 0


def bench_daemon_config(*, threads: int = _SERVER_THREADS_DEFAULT, data_listen: str = "") -> str:
    """The benchmark daemon's config: the tokenless ``local`` tenant (unix socket) and ``bench``
    (token, for TCP), both without a concurrency cap that 64 callers x 64 items would hit; the
    data path on ``data_listen`` when given."""
    from evald.daemon import hash_token

    # A loaded machine can hold a thread off the CPU for longer than the default 100 ms
    # deadline: the benchmark measures cost, so deadlines are far away.
    limits = f"[tenants.limits]\nmax_concurrency = 1000000\ndeadline_ms = {BENCH_DEADLINE_MS}\n"
    return (
        "[server]\n"
        f"threads = {threads}\n"
        + (f'data_listen = "{data_listen}"\n' if data_listen else "")
        + "max_batch_items = 4096\n"
        'log_level = "warning"\n'
        "shutdown_grace_s = 2\n"
        '[[tenants]]\nname = "local"\nevaluators = ["*"]\nallow_register = true\n'
        + limits
        + '[[tenants]]\nname = "bench"\n'
        + f'token_sha256 = "{hash_token(BENCH_TOKEN)}"\nevaluators = ["*"]\n'
        + limits
    )


# -- in-process paths ----------------------------------------------------------------------


def _run_threads(
    calls: Sequence[Callable[[], object]], duration_s: float, items_per_call: int = 1
) -> _Slice:
    """One thread per call in ``calls``, each calling its own in a closed loop for ``duration_s``.

    Each thread makes one untimed call first (it builds that thread's wasm instance, or checks
    its connection's answers), then all start together. A call that returns an int returns
    how many of its results were wrong.
    """
    concurrency = len(calls)
    latencies: list[list[int]] = [[] for _ in range(concurrency)]
    wrong = [0] * concurrency
    barrier = threading.Barrier(concurrency + 1)
    end_ns = [0]
    errors: list[BaseException] = []

    def worker(index: int, call: Callable[[], object]) -> None:
        sink = latencies[index]
        try:
            call()
        except BaseException as exc:
            errors.append(exc)
        barrier.wait()
        if errors:
            return
        clock = time.perf_counter_ns
        end = end_ns[0]
        append = sink.append
        bad = 0
        while True:
            started = clock()
            result = call()
            now = clock()
            append(now - started)
            if type(result) is int:
                bad += result
            if now >= end:
                wrong[index] = bad
                return

    threads = [
        threading.Thread(target=worker, args=(i, call), daemon=True, name=f"bench-{i}")
        for i, call in enumerate(calls)
    ]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    end_ns[0] = time.perf_counter_ns() + int(duration_s * 1e9)
    barrier.wait()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    merged = [x for sink in latencies for x in sink]
    return _Slice(merged, len(merged) * items_per_call, wall, sum(wrong))


class _InProcess:
    """The three in-process paths; one host per isolation mode, kept for the whole run."""

    def __init__(self, inputs: Sequence[str]) -> None:
        from evald.host import HostConfig, Limits, WasmHost
        from evaluators_wasm import wasm_path
        from evaluators_wasm.reference import reference

        self._limits = Limits(deadline_ms=BENCH_DEADLINE_MS)
        self._reuse = WasmHost(HostConfig(isolation="reuse"))
        self._fresh = WasmHost(HostConfig(isolation="fresh"))
        self._modules: dict[tuple[str, str], Any] = {}
        self._references: dict[str, Callable[[bytes], str]] = {}
        for name in inputs:
            evaluator, data = INPUTS[name]
            if evaluator not in self._references:
                wasm = wasm_path(evaluator).read_bytes()
                self._modules["reuse", evaluator] = self._reuse.load(wasm)
                self._modules["fresh", evaluator] = self._fresh.load(wasm)
                self._references[evaluator] = reference(evaluator)
            expected = self._references[evaluator](data)
            for mode, host in (("reuse", self._reuse), ("fresh", self._fresh)):
                outcome = host.evaluate(self._modules[mode, evaluator], data, self._limits)
                if outcome.value != expected:
                    raise RuntimeError(
                        f"{evaluator} ({mode}) gives {outcome.value or outcome.error!r} on "
                        f"{name}; its Python reference gives {expected!r}"
                    )
        self.expected = {
            name: self._references[INPUTS[name][0]](INPUTS[name][1]) for name in inputs
        }

    def caller(self, config: _Config) -> Callable[[], object]:
        evaluator, data = INPUTS[config.input]
        if config.path == "python":
            function = self._references[evaluator]
            return lambda: function(data)
        mode = "reuse" if config.path == "wasm-reuse" else "fresh"
        host = self._reuse if mode == "reuse" else self._fresh
        module = self._modules[mode, evaluator]
        limits = self._limits
        return lambda: host.evaluate(module, data, limits)

    def close(self) -> None:
        self._modules.clear()
        self._reuse.close()
        self._fresh.close()


# -- the daemon ----------------------------------------------------------------------------


class _Daemons:
    """The daemon on a unix socket and a second one on loopback TCP, plus ``grpc.aio`` stubs
    on one event loop owned by this object (driven from the calling thread)."""

    def __init__(self, root: Path, transports: Sequence[str]) -> None:
        from evald.testing import free_port, start_daemon

        self.loop = asyncio.new_event_loop()
        self._processes: dict[str, Any] = {}
        self.targets: dict[str, str] = {}
        self.metadata: dict[str, tuple[tuple[str, str], ...]] = {}
        self.data_target: str | None = None
        self._raw: _RawFloor | None = None
        grpc_transports = [t for t in transports if t in _GRPC_TRANSPORTS]
        if _DATA in transports and "uds" not in grpc_transports:
            grpc_transports.insert(0, "uds")  # the data path is served by the uds daemon
        config = bench_daemon_config()
        try:
            for transport in grpc_transports:
                daemon: Any
                if transport == "uds":
                    data_listen = f"unix:{root / 'data.sock'}" if _DATA in transports else ""
                    daemon = start_daemon(
                        root / "uds", bench_daemon_config(data_listen=data_listen)
                    )
                    self.targets[transport] = daemon.target
                    self.metadata[transport] = ()
                    if data_listen:
                        self.data_target = data_listen
                elif transport == "tcp":
                    listen = f"127.0.0.1:{free_port()}"
                    daemon = start_daemon(root / "tcp", config, listen=listen)
                    self.targets[transport] = listen
                    self.metadata[transport] = (("authorization", f"Bearer {BENCH_TOKEN}"),)
                else:
                    raise ValueError(f"unknown transport {transport!r}; use uds or tcp")
                self._processes[transport] = daemon
            if _DATA in transports:
                self._raw = _RawFloor(root / "raw.sock")
            self.stubs = self.loop.run_until_complete(self._connect())
        except BaseException:
            self.close()
            raise

    async def _connect(self) -> dict[str, Any]:
        import grpc

        from evald.contract import pb_grpc

        options = (
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        )
        self._channels = {
            transport: grpc.aio.insecure_channel(target, options=options)
            for transport, target in self.targets.items()
        }
        for channel in self._channels.values():
            await asyncio.wait_for(channel.channel_ready(), timeout=30)
        return {
            transport: pb_grpc.EvaluatorStub(channel)  # type: ignore[no-untyped-call]
            for transport, channel in self._channels.items()
        }

    def pid(self, config: _Config) -> int:
        """The process that answers ``config``'s calls (for its CPU time)."""
        if config.path == "raw-uds":
            assert self._raw is not None
            return self._raw.pid
        transport = "uds" if config.transport == _DATA else config.transport
        assert transport is not None
        return int(self._processes[transport].pid)

    def run_threaded_slice(self, config: _Config, duration_s: float, expected: str) -> _Slice:
        """A slice on the data path or the raw floor: a thread and a connection per caller."""
        from evald.client import DataConnection
        from evald.contract import pb

        if config.path == "raw-uds":
            assert self._raw is not None
            target = self._raw.target
        else:
            assert self.data_target is not None
            target = self.data_target
        evaluator, data = INPUTS[config.input]
        k = config.items
        message = pb.EvaluateBatchRequest(
            items=[pb.EvaluateRequest(evaluator=evaluator, input=data, id=str(i)) for i in range(k)]
        )
        if config.path == "raw-uds":
            from evald_lab.bench._raw_floor import ANSWER

            expected = ANSWER
        connections = [DataConnection.connect(target) for _ in range(config.concurrency)]

        def caller(connection: DataConnection) -> Callable[[], int]:
            def call() -> int:
                connection.send(message)
                got = wrong = 0
                while got < k:
                    response = connection.receive()
                    if response is None:
                        raise RuntimeError(f"{target} closed the benchmark connection")
                    for result in response.results:
                        got += 1
                        if result.value != expected:
                            wrong += 1
                return wrong

            return call

        try:
            first = [caller(connection)() for connection in connections]
            if any(first):
                raise RuntimeError(f"{target} answered other than {expected!r} on {config.label}")
            return _run_threads([caller(c) for c in connections], duration_s, k)
        finally:
            for connection in connections:
                connection.close()

    def run_slice(self, config: _Config, duration_s: float, expected: str) -> _Slice:
        return self.loop.run_until_complete(self._slice(config, duration_s, expected))

    async def _slice(self, config: _Config, duration_s: float, expected: str) -> _Slice:
        from evald.contract import pb

        assert config.transport is not None and config.rpc is not None
        stub = self.stubs[config.transport]
        metadata = self.metadata[config.transport]
        evaluator, data = INPUTS[config.input]
        k = config.items
        items = [pb.EvaluateRequest(evaluator=evaluator, input=data, id=str(i)) for i in range(k)]
        message = pb.EvaluateBatchRequest(items=items)
        callers = [
            _AsyncCaller(stub, metadata, config.rpc, items[0], message, k, expected)
            for _ in range(config.concurrency)
        ]
        await asyncio.gather(*(caller.open() for caller in callers))
        started = time.perf_counter()
        end_ns = time.perf_counter_ns() + int(duration_s * 1e9)
        await asyncio.gather(*(caller.run(end_ns) for caller in callers))
        wall = time.perf_counter() - started
        await asyncio.gather(*(caller.close() for caller in callers))
        merged = [x for caller in callers for x in caller.latencies_ns]
        return _Slice(merged, len(merged) * k, wall, sum(caller.errors for caller in callers))

    def close(self) -> None:
        channels = getattr(self, "_channels", {})
        if channels and not self.loop.is_closed():

            async def close_channels() -> None:
                await asyncio.gather(*(channel.close() for channel in channels.values()))

            self.loop.run_until_complete(close_channels())
        if not self.loop.is_closed():
            self.loop.close()
        for daemon in self._processes.values():
            daemon.stop()
        self._processes.clear()
        if self._raw is not None:
            self._raw.close()
            self._raw = None


class _RawFloor:
    """The raw floor's server process (:mod:`evald_lab.bench._raw_floor`)."""

    def __init__(self, path: Path) -> None:
        import subprocess
        import sys

        self.target = f"unix:{path}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "evald_lab.bench._raw_floor", str(path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the raw-floor server did not start")

    @property
    def pid(self) -> int:
        return self._process.pid

    def close(self) -> None:
        self._process.kill()
        self._process.wait(timeout=10)
        if self._process.stdout is not None:
            self._process.stdout.close()


class _AsyncCaller:
    """One closed-loop caller on the daemon: unary, batch or a stream of its own."""

    def __init__(
        self,
        stub: Any,
        metadata: tuple[tuple[str, str], ...],
        rpc: str,
        request: Any,
        message: Any,
        items: int,
        expected: str,
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._rpc = rpc
        self._request = request
        self._message = message
        self._items = items
        self._expected = expected
        self._call: Any = None
        self.latencies_ns: list[int] = []
        self.errors = 0

    async def _round_trip(self) -> list[Any]:
        if self._rpc == "unary":
            return [await self._stub.Evaluate(self._request, metadata=self._metadata)]
        if self._rpc == "batch":
            response = await self._stub.EvaluateBatch(self._message, metadata=self._metadata)
            return list(response.results)
        import grpc

        await self._call.write(self._message)
        results: list[Any] = []
        while len(results) < self._items:
            response = await self._call.read()
            if response is grpc.aio.EOF:
                raise RuntimeError("the daemon ended the benchmark stream")
            results.extend(response.results)
        return results

    async def open(self) -> None:
        """Opens the stream (stream mode) and checks one untimed round trip's values."""
        if self._rpc == "stream":
            self._call = self._stub.EvaluateStream(metadata=self._metadata)
        results = await self._round_trip()
        bad = [
            r for r in results if r.WhichOneof("outcome") != "value" or r.value != self._expected
        ]
        if bad or len(results) != self._items:
            raise RuntimeError(
                f"the daemon answered {bad[0] if bad else results!r}; expected "
                f"{self._items} x {self._expected!r}"
            )

    async def run(self, end_ns: int) -> None:
        clock = time.perf_counter_ns
        append = self.latencies_ns.append
        expected = self._expected
        while True:
            started = clock()
            results = await self._round_trip()
            now = clock()
            append(now - started)
            for result in results:
                if result.value != expected:
                    self.errors += 1
            if now >= end_ns:
                return

    async def close(self) -> None:
        if self._call is not None:
            import grpc

            await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass


# -- the decode step -----------------------------------------------------------------------


class _DecodeStep:
    """Times single-token forwards of the local engine's model (llama.cpp, SmolLM2-135M)."""

    def __init__(self) -> None:
        from engine_adapter.local import load_backend

        self._backend: Any = load_backend("llama", n_ctx=256)
        self._context = [1, 504, 3058, 31, 2, 198, 1, 4093, 198]  # a short chat preamble
        self._backend.forward(self._context)

    def sample(self, steps: int) -> list[int]:
        """``steps`` one-token forwards after the context, in nanoseconds each."""
        backend = self._backend
        backend.truncate(len(self._context))
        out = []
        token = 28
        for _ in range(steps):
            started = time.perf_counter_ns()
            backend.forward([token])
            out.append(time.perf_counter_ns() - started)
            token = 28 + (token + 7) % 200
        return out

    def close(self) -> None:
        self._backend.close()


def _open_decode_step(bars: Progress) -> _DecodeStep | None:
    try:
        return _DecodeStep()
    except Exception as exc:  # no llama extra, no model: the fractions stay empty
        bars.log(f"decode step not measured ({type(exc).__name__}: {exc})")
        return None


# -- the run -------------------------------------------------------------------------------


def _configs(profile: OverheadProfile) -> list[_Config]:
    configs: list[_Config] = []
    for name, concurrency in itertools.product(profile.inputs, profile.concurrency):
        for path in ("python", "wasm-reuse", "wasm-fresh"):
            configs.append(_Config(path, name, concurrency))
        for transport in profile.transports:
            if transport == _DATA:
                for items in profile.items_per_message:
                    configs.append(_Config("evald", name, concurrency, _DATA, "stream", items))
                    configs.append(_Config("raw-uds", name, concurrency, None, "stream", items))
                continue
            configs.append(_Config("evald", name, concurrency, transport, "unary", 1))
            for rpc, items in itertools.product(("batch", "stream"), profile.items_per_message):
                configs.append(_Config("evald", name, concurrency, transport, rpc, items))
    return configs


def run_overhead(
    profile: OverheadProfile | str = "full",
    *,
    out_dir: Path = DEFAULT_OUT_DIR,
    show_progress: bool = True,
    measure_decode_step: bool = True,
    plot: bool = True,
) -> dict[str, Any]:
    """Runs the overhead benchmark; writes ``overhead.json`` (and ``overhead.png``) under
    ``out_dir`` and returns the result document.

    Raises:
        KeyError: an unknown profile name.
        RuntimeError: a path gives a value other than the Python reference's, or a daemon does
            not start (the message carries its log).
    """
    if isinstance(profile, str):
        profile = PROFILES[profile]
    configs = _configs(profile)
    machine = machine_info()
    started = time.perf_counter()
    tallies = {config: _Tally() for config in configs}
    step_samples: list[int] = []
    with Progress(show_progress) as bars, tempfile.TemporaryDirectory(prefix="evald-bench-") as tmp:
        bars.task("overhead", profile.rounds * len(configs))
        bars.describe("overhead", "overhead: starting daemons")
        in_process = _InProcess(profile.inputs)
        daemons: _Daemons | None = None
        decode: _DecodeStep | None = None
        try:
            daemons = _Daemons(Path(tmp), profile.transports)
            if measure_decode_step:
                bars.describe("overhead", "overhead: loading the model")
                decode = _open_decode_step(bars)
                if decode is not None:
                    decode.sample(2)  # warm
            for round_index in range(profile.rounds):
                if decode is not None:
                    step_samples.extend(decode.sample(profile.decode_steps_per_round))
                # Rotate the order each round so no configuration always follows another.
                shift = (round_index * len(configs)) // max(1, profile.rounds)
                for config in configs[shift:] + configs[:shift]:
                    bars.describe("overhead", f"overhead r{round_index + 1}: {config.label}")
                    _measure(config, profile, in_process, daemons, tallies[config])
                    bars.advance("overhead")
        finally:
            if decode is not None:
                decode.close()
            if daemons is not None:
                daemons.close()
            in_process.close()
    document = _document(profile, configs, tallies, step_samples, machine, started)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "overhead.json", document)
    if plot:
        from evald_lab.bench._plots import plot_overhead

        plot_overhead(document, out_dir / "overhead.png")
    return document


def _measure(
    config: _Config,
    profile: OverheadProfile,
    in_process: _InProcess,
    daemons: _Daemons | None,
    tally: _Tally,
) -> None:
    cpu_before = time.process_time()
    daemon_before: float | None = None
    if config.path in ("evald", "raw-uds"):
        assert daemons is not None
        pid = daemons.pid(config)
        daemon_before = cpu_seconds_of(pid)
        expected = in_process.expected[config.input]
        if config.transport in _GRPC_TRANSPORTS:
            result = daemons.run_slice(config, profile.slice_s, expected)
        else:
            result = daemons.run_threaded_slice(config, profile.slice_s, expected)
        daemon_after = cpu_seconds_of(pid)
        if daemon_before is not None and daemon_after is not None:
            tally.daemon_cpu_s = (tally.daemon_cpu_s or 0.0) + daemon_after - daemon_before
    else:
        duration = profile.slice_s
        if config.path == "wasm-fresh":
            duration *= profile.fresh_slice_fraction
        result = _run_threads([in_process.caller(config)] * config.concurrency, duration)
    tally.client_cpu_s += time.process_time() - cpu_before
    tally.latencies_ns.extend(result.latencies_ns)
    tally.items += result.items
    tally.errors += result.errors
    tally.wall_s += result.wall_s


def _document(
    profile: OverheadProfile,
    configs: Sequence[_Config],
    tallies: dict[_Config, _Tally],
    step_samples: Sequence[int],
    machine: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    step = summarize_ns(step_samples) if step_samples else None
    step_p50 = step["p50_us"] if step else None
    rows: list[dict[str, Any]] = []
    for config in configs:
        tally = tallies[config]
        stats = summarize_ns(tally.latencies_ns)
        items = max(1, tally.items)
        evaluator, data = INPUTS[config.input]
        row: dict[str, Any] = {
            "path": config.path,
            "transport": config.transport,
            "rpc": config.rpc,
            "items_per_message": config.items,
            "concurrency": config.concurrency,
            "input": config.input,
            "evaluator": evaluator,
            "input_bytes": len(data),
            "evals": tally.items,
            "errors": tally.errors,
            **{key: value for key, value in stats.items() if key != "n"},
            "evals_per_s": round(tally.items / tally.wall_s, 1) if tally.wall_s else 0.0,
            "client_cpu_us_per_eval": round(tally.client_cpu_s / items * 1e6, 2),
            "daemon_cpu_us_per_eval": (
                round(tally.daemon_cpu_s / items * 1e6, 2)
                if tally.daemon_cpu_s is not None
                else None
            ),
        }
        cpu_total = row["client_cpu_us_per_eval"] + (row["daemon_cpu_us_per_eval"] or 0.0)
        row["cpu_us_per_eval"] = round(cpu_total, 2)
        rows.append(row)
    baseline = {(row["input"], row["concurrency"]): row for row in rows if row["path"] == "python"}
    for row in rows:
        base = baseline.get((row["input"], row["concurrency"]))
        row["vs_python_p50"] = (
            round(row["p50_us"] / base["p50_us"], 3) if base and base["p50_us"] else None
        )
        row["vs_python_throughput"] = (
            round(row["evals_per_s"] / base["evals_per_s"], 3)
            if base and base["evals_per_s"]
            else None
        )
        row["decode_step_fraction"] = round(row["p50_us"] / step_p50, 4) if step_p50 else None
    return {
        "benchmark": "overhead",
        "schema": SCHEMA_VERSION,
        "profile": profile.name,
        "settings": {
            "rounds": profile.rounds,
            "slice_s": profile.slice_s,
            "inputs": {name: INPUTS[name][1].decode() for name in profile.inputs},
            "concurrency": list(profile.concurrency),
            "items_per_message": list(profile.items_per_message),
            "transports": list(profile.transports),
            "daemon_threads": os.cpu_count(),
        },
        "machine": {**machine, "load_average_at_end": load_average()},
        "wall_s": round(time.perf_counter() - started, 1),
        "decode_step": step,
        "rows": rows,
        "headline": overhead_headline(rows, step),
    }


def _find(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(key) == value for key, value in match.items()):
            return row
    return None


def overhead_headline(
    rows: Sequence[dict[str, Any]], decode_step: dict[str, Any] | None
) -> dict[str, Any]:
    """The overhead numbers the issue asks for, from a run's rows.

    * ``evald_vs_python_latency``: p50 of the engine's path (unix socket, one stream, one item
      per message, concurrency 1) on the short calc input, over the Python reference's p50;
      also for unary ``Evaluate``.
    * ``evald_data_vs_python_latency``: the same on the data path.
    * ``evald_data_vs_raw_floor``: the data path's p50 over the raw unix-socket floor's (the same
      frames to a process that does not evaluate), against the ≤ 5x and ≤ 300 µs targets.
    * ``wasm_reuse_vs_python_latency`` (target ≤ 1) and ``wasm_fresh_p50_us`` (target ≤ 50 µs).
    * ``wasm_fresh_vs_reuse``: in-process fresh ÷ reuse p50 at concurrency 1, every input of
      the run (target ≤ 2.0 each).
    * ``evald_batched_throughput``: the best items/s of any 64-item batch or stream row on a
      unix socket (gRPC or the data path; short calc), against the 30,000/s target, with the
      CPU it cost per item (target ≤ 30 µs in the daemon).
    """
    python = _find(rows, path="python", input="calc-short", concurrency=1)
    headline: dict[str, Any] = {}
    for key, transport, rpc in (
        ("evald_vs_python_latency", "uds", "stream"),
        ("evald_unary_vs_python_latency", "uds", "unary"),
        ("evald_data_vs_python_latency", _DATA, "stream"),
    ):
        row = _find(
            rows,
            path="evald",
            transport=transport,
            rpc=rpc,
            items_per_message=1,
            concurrency=1,
            input="calc-short",
        )
        if row and python and python["p50_us"]:
            headline[key] = {
                "value": round(row["p50_us"] / python["p50_us"], 2),
                "evald_p50_us": row["p50_us"],
                "python_p50_us": python["p50_us"],
                "decode_step_fraction": row["decode_step_fraction"],
            }
    data = _find(
        rows,
        path="evald",
        transport=_DATA,
        items_per_message=1,
        concurrency=1,
        input="calc-short",
    )
    raw = _find(rows, path="raw-uds", items_per_message=1, concurrency=1, input="calc-short")
    if data and raw and raw["p50_us"]:
        ratio = round(data["p50_us"] / raw["p50_us"], 2)
        headline["evald_data_vs_raw_floor"] = {
            "value": ratio,
            "target": 5.0,
            "met": ratio <= 5.0 and data["p50_us"] <= 300,
            "evald_p50_us": data["p50_us"],
            "raw_p50_us": raw["p50_us"],
            "p50_target_us": 300,
        }
    reuse = _find(rows, path="wasm-reuse", input="calc-short", concurrency=1)
    if reuse and python and python["p50_us"]:
        ratio = round(reuse["p50_us"] / python["p50_us"], 2)
        headline["wasm_reuse_vs_python_latency"] = {
            "value": ratio,
            "target": 1.0,
            "met": ratio <= 1.0,
            "wasm_p50_us": reuse["p50_us"],
            "wasm_cpu_us_per_eval": reuse["cpu_us_per_eval"],
            "python_p50_us": python["p50_us"],
        }
    fresh = _find(rows, path="wasm-fresh", input="calc-short", concurrency=1)
    if fresh:
        headline["wasm_fresh_p50_us"] = {
            "value": fresh["p50_us"],
            "target": 50,
            "met": fresh["p50_us"] <= 50,
            "cpu_us_per_eval": fresh["cpu_us_per_eval"],
        }
    ratios = {}
    for name in dict.fromkeys(row["input"] for row in rows):
        reused = _find(rows, path="wasm-reuse", input=name, concurrency=1)
        made = _find(rows, path="wasm-fresh", input=name, concurrency=1)
        if reused and made and reused["p50_us"]:
            ratios[name] = {
                "value": round(made["p50_us"] / reused["p50_us"], 2),
                "fresh_p50_us": made["p50_us"],
                "reuse_p50_us": reused["p50_us"],
            }
    if ratios:
        headline["wasm_fresh_vs_reuse"] = {
            "target": 2.0,
            "met": all(r["value"] <= 2.0 for r in ratios.values()),
            "inputs": ratios,
        }
    batched = [
        row
        for row in rows
        if row["path"] == "evald"
        and row["transport"] in ("uds", _DATA)
        and row["items_per_message"] == 64
        and row["input"] == "calc-short"
    ]
    if batched:
        best = max(batched, key=lambda row: row["evals_per_s"])
        daemon_cpu = best["daemon_cpu_us_per_eval"]
        headline["evald_batched_throughput"] = {
            "value": best["evals_per_s"],
            "target": 30_000,
            "met": best["evals_per_s"] >= 30_000 and daemon_cpu is not None and daemon_cpu <= 30,
            "daemon_cpu_target_us": 30,
            "transport": best["transport"],
            "rpc": best["rpc"],
            "concurrency": best["concurrency"],
            "daemon_cpu_us_per_eval": daemon_cpu,
            "client_cpu_us_per_eval": best["client_cpu_us_per_eval"],
            # What the daemon alone could do with every core of this machine.
            "daemon_cpu_bound_evals_per_s": (
                round((os.cpu_count() or 1) * 1e6 / daemon_cpu) if daemon_cpu else None
            ),
        }
    if decode_step:
        headline["decode_step_p50_us"] = decode_step["p50_us"]
    return headline
