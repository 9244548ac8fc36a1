"""The fleet store's bounds, measured with 3 daemons following one real PostgreSQL on this
machine, and the hot path with the store on against the embedded store.

    evald bench control-plane [--samples N] [--calls N] [--rounds R] [--out DIR]

One PostgreSQL (the machine's binaries, a fresh cluster: :func:`evald.testing.start_postgres`),
a store set up as ``evald store init`` does, and 3 daemons logging in with the daemons' role,
each with a data path. Measured, each ``--samples`` times:

* **registration**: from the moment a registration returns on one daemon (committed) until the
  module serves on each of the 3 (a caller polling it on each daemon from its own thread);
* **revocation**: a token is revoked through the operators' role; from the commit until each
  daemon refuses a new call with it, until an open gRPC stream on it ends ``unauthenticated``,
  and until an open data-path connection on it ends ``unauthenticated``;
* **limits**: ``input_bytes`` flips between 10 and 1,000; once a daemon reports the revision,
  its next call is checked against the new limit (the fraction that saw it, and the time);
* **hot path**: sequential unary ``calc`` calls on a daemon with the store on and on one with
  the embedded store, interleaved in ``--rounds`` rounds; the ratio of medians (target 1.00 ±
  noise: the store is off the call path).

Writes ``control_plane.json`` and ``control_plane.png`` to ``--out`` (default reports/bench).
The bounds of the design: registration and revocation p99 ≤ 1 s on every daemon.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from evald.client import CallError, Client, DataCallError, DataConnection
from evald.contract import pb, pb_grpc
from evald.daemon import hash_token, init_store, store_database
from evald.testing import DaemonProcess, named_guest, start_daemon, start_postgres, tenant_table
from evald_lab.bench._common import (
    DEFAULT_OUT_DIR,
    load_average,
    machine_info,
    percentile,
    write_json,
)

__all__ = ["add_arguments", "main", "run"]

DAEMONS = 3
BOUND_S = 1.0
_POLL_S = 0.001
_GIVE_UP_S = 30.0
_EMBEDDED_TOKEN = "embedded-bench-token-0123456789"


def _figures(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "n": len(ordered),
        "p50_ms": round(percentile(ordered, 0.50) * 1000, 2),
        "p99_ms": round(percentile(ordered, 0.99) * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def _wait(check: Callable[[], bool]) -> float:
    """Seconds until ``check()`` holds (polling every millisecond)."""
    began = time.perf_counter()
    while not check():
        if time.perf_counter() - began > _GIVE_UP_S:
            raise RuntimeError("a daemon never applied the change")
        time.sleep(_POLL_S)
    return time.perf_counter() - began


def _on_each(checks: list[Callable[[], bool]], started: threading.Event) -> list[float]:
    """Each check polled from its own thread from the moment ``started`` is set; the seconds
    until each held."""
    results: list[float] = [0.0] * len(checks)

    def poll(index: int) -> None:
        started.wait()
        results[index] = _wait(checks[index])

    threads = [threading.Thread(target=poll, args=(i,)) for i in range(len(checks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _in_background(
    checks: list[Callable[[], bool]], started: threading.Event
) -> tuple[threading.Thread, list[list[float]]]:
    """:func:`_on_each` on a thread of its own, started now; its result lands in the list."""
    results: list[list[float]] = []
    runner = threading.Thread(target=lambda: results.append(_on_each(checks, started)))
    runner.start()
    return runner, results


def _serves(client: Client, name: str) -> Callable[[], bool]:
    def check() -> bool:
        outcome: str | None = client.evaluate(name, b"x").WhichOneof("outcome")
        return outcome == "value"

    return check


def _refuses(client: Client) -> Callable[[], bool]:
    def check() -> bool:
        try:
            client.evaluate("calc", "1+1")
        except CallError:
            return True
        return False

    return check


class _Bench:
    """The cluster, its store and its daemons."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[DaemonProcess] = []
        self.clients: list[Client] = []
        self.server = start_postgres()
        try:
            self.server.create_database("bench")
            init_store(self.server.store_settings(database="bench"))
            self.server.create_login("pod", "evald_daemon")
            self.server.create_login("ops", "evald_operator")
            self.operator = store_database(
                self.server.store_settings("ops", "bench"), application="bench"
            )
        except BaseException:
            self.server.close()  # a failed setup leaves no cluster running
            raise

    def fleet_config(self, root: Path) -> str:
        return "\n".join(
            [
                "[server]",
                "threads = 2",
                "shutdown_grace_s = 2",
                f'data_listen = "unix:{root}/data.sock"',
                "[store]",
                f'url = "{self.server.url("pod", "bench")}"',
                f'password_file = "{self.server.password_file("pod")}"',
            ]
        )

    def start(self) -> None:
        for index in range(DAEMONS):
            root = self.root / f"daemon{index}"
            root.mkdir(parents=True)
            self.daemons.append(start_daemon(root, self.fleet_config(root)))
        embedded = self.root / "embedded"
        self.embedded: DaemonProcess = start_daemon(
            embedded,
            "\n".join(
                [
                    "[server]",
                    "threads = 2",
                    "shutdown_grace_s = 2",
                    tenant_table("bench", token=_EMBEDDED_TOKEN, evaluators=["*"]),
                ]
            ),
        )

    def add_tenant(self, name: str, limits: dict[str, Any] | None = None) -> str:
        token = f"{name}-{os.urandom(8).hex()}"
        self.operator.add_tenant(
            "bench",
            name,
            [hash_token(token)],
            limits=limits or {},
            evaluators=["*"],
            may_register=True,
            max_modules=1000,
        )
        self.until_applied(token)
        return token

    def client(self, index: int, token: str | None) -> Client:
        handle = Client(self.daemons[index].target, token, timeout_s=30.0)
        self.clients.append(handle)
        return handle

    def until_applied(self, token: str) -> None:
        revision = self.operator.head()
        for index in range(DAEMONS):
            probe = self.client(index, token)

            def applied(probe: Client = probe) -> bool:
                try:
                    return probe.revision() >= revision
                except CallError:
                    return False

            _wait(applied)

    def close(self) -> None:
        for handle in self.clients:
            handle.close()
        for daemon in (*self.daemons, getattr(self, "embedded", None)):
            if daemon is not None and daemon.alive():
                daemon.stop()
        self.operator.close()
        self.server.close()


def _registration(bench: _Bench, samples: int) -> dict[str, Any]:
    token = bench.add_tenant("reg")
    pollers = [bench.client(index, token) for index in range(DAEMONS)]
    per_daemon: list[float] = []
    slowest: list[float] = []
    for sample in range(samples):
        name = f"m{sample}"
        wasm = named_guest("echo", name)
        started = threading.Event()
        runner, results = _in_background([_serves(client, name) for client in pollers], started)
        bench.client(sample % DAEMONS, token).register(wasm)
        started.set()  # committed: the clock starts
        runner.join()
        per_daemon.extend(results[0])
        slowest.append(max(results[0]))
    return {"per_daemon": _figures(per_daemon), "slowest_daemon": _figures(slowest)}


def _stream(target: str, token: str) -> tuple[queue.Queue[Any], Iterator[Any]]:
    channel = grpc.insecure_channel(target)
    outgoing: queue.Queue[Any] = queue.Queue()

    def requests() -> Iterator[Any]:
        while (message := outgoing.get()) is not None:
            yield message

    stub = pb_grpc.EvaluatorStub(channel)  # type: ignore[no-untyped-call]
    responses = stub.EvaluateStream(
        requests(), metadata=(("authorization", f"Bearer {token}"),), timeout=120
    )
    return outgoing, responses


def _item() -> Any:
    return pb.EvaluateBatchRequest(
        items=[pb.EvaluateRequest(evaluator="calc", input=b"1+1", id="1")]
    )


def _watch(
    opened: tuple[Any, Any, DataConnection],
    started: threading.Event,
    ended: list[tuple[float, float]],
    index: int,
    codes: set[str],
) -> None:
    """Seconds from ``started`` until the open stream ends, and until the data connection
    does (their codes into ``codes``)."""
    _outgoing, responses, data = opened
    started.wait()
    began = time.perf_counter()
    try:
        next(responses)
    except grpc.RpcError as error:
        codes.add(dict(error.trailing_metadata() or ()).get("evald-error-code", "?"))
    stream_s = time.perf_counter() - began
    try:
        while data.receive() is not None:
            pass
    except DataCallError as error:
        codes.add(f"data:{error.code.value}")
    ended[index] = (stream_s, time.perf_counter() - began)


def _revocation(bench: _Bench, samples: int) -> dict[str, Any]:
    keeper = bench.add_tenant("rev")  # the tenant keeps this token throughout
    refused: list[float] = []
    streams: list[float] = []
    connections: list[float] = []
    codes: set[str] = set()
    for _sample in range(samples):
        token = f"rev-{os.urandom(8).hex()}"
        bench.operator.add_token("bench", "rev", hash_token(token))
        bench.until_applied(keeper)
        opened = []
        for daemon in bench.daemons:
            outgoing, responses = _stream(daemon.target, token)
            outgoing.put(_item())
            next(responses)
            data = DataConnection.connect(f"unix:{daemon.config_path.parent}/data.sock", token)
            data.send(_item())
            data.receive()
            opened.append((outgoing, responses, data))
        unary = [bench.client(index, token) for index in range(DAEMONS)]
        ended: list[tuple[float, float]] = [(0.0, 0.0)] * DAEMONS
        started = threading.Event()
        watchers = [
            threading.Thread(target=_watch, args=(opened[i], started, ended, i, codes))
            for i in range(DAEMONS)
        ]
        for thread in watchers:
            thread.start()
        runner, results = _in_background([_refuses(client) for client in unary], started)
        bench.operator.remove_tokens("bench", "rev", [hash_token(keeper)])
        started.set()
        runner.join()
        for thread in watchers:
            thread.join()
        refused.extend(results[0])
        streams.extend(stream for stream, _ in ended)
        connections.extend(connection for _, connection in ended)
        for outgoing, _responses, data in opened:
            outgoing.put(None)
            data.close()
    return {
        "new_call_refused": _figures(refused),
        "stream_ended": _figures(streams),
        "data_connection_ended": _figures(connections),
        "codes": sorted(codes),
    }


def _at(client: Client, revision: int) -> Callable[[], bool]:
    def check() -> bool:
        return client.revision() >= revision

    return check


def _limits(bench: _Bench, samples: int) -> dict[str, Any]:
    token = bench.add_tenant("lim", {"input_bytes": 1000})
    clients = [bench.client(index, token) for index in range(DAEMONS)]
    applied: list[float] = []
    right = 0
    for sample in range(samples):
        small = sample % 2 == 0
        limit = 10 if small else 1000
        revision = bench.operator.update_tenant("bench", "lim", limits={"input_bytes": limit})
        committed = time.perf_counter()
        for client in clients:
            _wait(_at(client, revision))
            applied.append(time.perf_counter() - committed)
            result = client.evaluate("calc", "1+" * 10 + "1")  # 21 bytes
            refused = result.WhichOneof("outcome") == "error"
            right += refused == small
    return {"applied": _figures(applied), "next_call_saw_it": right / (samples * DAEMONS)}


def _hot_path(bench: _Bench, calls: int, rounds: int) -> dict[str, Any]:
    token = bench.add_tenant("hot")
    fleet = bench.client(0, token)
    embedded = Client(bench.embedded.target, _EMBEDDED_TOKEN, timeout_s=30.0)
    bench.clients.append(embedded)
    medians: dict[str, list[float]] = {"fleet": [], "embedded": []}
    samples: dict[str, list[float]] = {"fleet": [], "embedded": []}
    for client in (fleet, embedded):  # warm up both
        for _ in range(50):
            client.evaluate("calc", "17 * 23 + 91")
    for _round in range(rounds):
        for label, client in (("fleet", fleet), ("embedded", embedded)):
            times = []
            for _ in range(calls):
                began = time.perf_counter()
                client.evaluate("calc", "17 * 23 + 91")
                times.append(time.perf_counter() - began)
            medians[label].append(statistics.median(times))
            samples[label].extend(times)
    ratio = statistics.median(
        f / e for f, e in zip(medians["fleet"], medians["embedded"], strict=True)
    )
    return {
        "fleet": _figures(samples["fleet"]),
        "embedded": _figures(samples["embedded"]),
        "ratio_p50": round(ratio, 3),
        "round_ratios": [
            round(f / e, 3) for f, e in zip(medians["fleet"], medians["embedded"], strict=True)
        ],
    }


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = [
        ("registration serves", result["registration"]["per_daemon"]),
        ("limits applied", result["limits"]["applied"]),
        ("new call refused", result["revocation"]["new_call_refused"]),
        ("stream ended", result["revocation"]["stream_ended"]),
        ("data conn. ended", result["revocation"]["data_connection_ended"]),
    ]
    positions = range(len(rows))
    axes[0].bar([p - 0.2 for p in positions], [r[1]["p50_ms"] for r in rows], 0.4, label="p50")
    axes[0].bar([p + 0.2 for p in positions], [r[1]["p99_ms"] for r in rows], 0.4, label="p99")
    axes[0].axhline(BOUND_S * 1000, color="red", linestyle="--", label="bound (1 s)")
    axes[0].set_xticks(list(positions), [r[0] for r in rows], rotation=20, fontsize=8)
    axes[0].set_ylabel("ms after the commit, per daemon")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    hot = result["hot_path"]
    axes[1].bar(["embedded", "fleet store"], [hot["embedded"]["p50_ms"], hot["fleet"]["p50_ms"]])
    axes[1].set_ylabel("unary calc p50 (ms)")
    axes[1].set_title(f"hot path: fleet / embedded = {hot['ratio_p50']:.2f}", fontsize=9)
    fig.suptitle(f"Control plane: {DAEMONS} daemons following one PostgreSQL (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(samples: int, calls: int, rounds: int, out: Path) -> dict[str, Any]:
    """Measures everything once; writes the result files (see the module)."""
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="evald-bench-cp-") as tmp:
        bench = _Bench(Path(tmp))
        try:
            bench.start()
            registration = _registration(bench, samples)
            revocation = _revocation(bench, samples)
            limits = _limits(bench, samples)
            hot_path = _hot_path(bench, calls, rounds)
        finally:
            bench.close()
    result: dict[str, Any] = {
        "benchmark": "control_plane",
        "daemons": DAEMONS,
        "samples": samples,
        "bound_ms": BOUND_S * 1000,
        "registration": registration,
        "revocation": revocation,
        "limits": limits,
        "hot_path": hot_path,
        "within_bounds": all(
            figures["p99_ms"] <= BOUND_S * 1000
            for figures in (
                registration["per_daemon"],
                revocation["new_call_refused"],
                revocation["stream_ended"],
                revocation["data_connection_ended"],
            )
        ),
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "control_plane.json", result)
    result["plot"] = _plot(result, out / "control_plane.png")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=30, help="changes measured per kind (30)")
    parser.add_argument("--calls", type=int, default=500, help="hot-path calls per round (500)")
    parser.add_argument("--rounds", type=int, default=5, help="hot-path rounds (5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, metavar="DIR")


def main(args: argparse.Namespace) -> int:
    result = run(args.samples, args.calls, args.rounds, args.out)
    registration = result["registration"]["per_daemon"]
    revocation = result["revocation"]
    print(
        f"registration serves on every daemon: p50 {registration['p50_ms']} ms, "
        f"p99 {registration['p99_ms']} ms (bound {result['bound_ms']:g} ms)"
    )
    print(
        "revoked token: new call refused p99 "
        f"{revocation['new_call_refused']['p99_ms']} ms, stream ended p99 "
        f"{revocation['stream_ended']['p99_ms']} ms, data connection ended p99 "
        f"{revocation['data_connection_ended']['p99_ms']} ms ({', '.join(revocation['codes'])})"
    )
    print(
        f"limits change: applied p99 {result['limits']['applied']['p99_ms']} ms, next call saw "
        f"it {result['limits']['next_call_saw_it']:.0%}"
    )
    print(f"hot path, fleet store / embedded (p50): {result['hot_path']['ratio_p50']:.3f}")
    print(f"wrote {args.out / 'control_plane.json'}")
    return 0
