"""Prometheus metrics of the daemon, on a private registry, served over HTTP when configured.

Labels are bounded: ``tenant`` comes from the config, ``evaluator`` from what a tenant can see
(names that resolve to nothing are counted as ``unknown``, so a client cannot grow the label set),
``outcome`` is ``ok`` or an error code. Latency buckets start at 5 µs because a guest call on a
reused instance takes a few microseconds.
"""

from __future__ import annotations

import threading
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

__all__ = ["FUEL_BUCKETS", "LATENCY_BUCKETS_S", "Metrics"]

#: Evaluation time buckets, in seconds: 5 µs … 1 s.
LATENCY_BUCKETS_S = (
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,
)  # fmt: skip
#: Fuel (≈ wasm instructions) buckets: 1e3 … 1e10, a decade apart.
FUEL_BUCKETS = tuple(float(10**exponent) for exponent in range(3, 11))

UNKNOWN_EVALUATOR_LABEL = "unknown"


class Metrics:
    """The daemon's metrics. Every method is thread-safe (guest threads record their outcomes)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.evaluations = Counter(
            "evald_evaluations",
            "Evaluations finished, by tenant, evaluator and outcome (ok or an error code).",
            ("tenant", "evaluator", "outcome"),
            registry=self.registry,
        )
        self.eval_seconds = Histogram(
            "evald_evaluation_seconds",
            "Time inside the wasm host per evaluation (queueing excluded).",
            ("tenant", "evaluator"),
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.fuel = Histogram(
            "evald_fuel_used",
            "Fuel consumed per evaluation (roughly wasm instructions).",
            ("tenant", "evaluator"),
            buckets=FUEL_BUCKETS,
            registry=self.registry,
        )
        self.rpcs = Counter(
            "evald_rpcs",
            "RPCs handled, by method, tenant (or 'unauthenticated') and evald error code.",
            ("method", "tenant", "code"),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "evald_inflight_evaluations",
            "Evaluations admitted and not yet finished, by tenant.",
            ("tenant",),
            registry=self.registry,
        )
        self.modules = Gauge(
            "evald_registered_modules",
            "Modules a tenant has registered.",
            ("tenant",),
            registry=self.registry,
        )
        # labels() costs a lock and a tuple hash per call: resolve each child once.
        self._evaluation_children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        self._rpc_children: dict[tuple[str, str, str], Any] = {}
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    def observe_evaluation(
        self, tenant: str, evaluator: str, outcome: str, elapsed_us: int, fuel_used: int
    ) -> None:
        """Records one finished evaluation."""
        key = (tenant, evaluator, outcome)
        children = self._evaluation_children.get(key)
        if children is None:
            children = (
                self.evaluations.labels(tenant, evaluator, outcome),
                self.eval_seconds.labels(tenant, evaluator),
                self.fuel.labels(tenant, evaluator),
            )
            self._evaluation_children[key] = children
        count, seconds, fuel = children
        count.inc()
        if elapsed_us or fuel_used:
            seconds.observe(elapsed_us / 1e6)
            fuel.observe(fuel_used)

    def observe_rpc(self, method: str, tenant: str, code: str) -> None:
        """Records one finished RPC; ``code`` is ``ok`` or the call-level error code."""
        key = (method, tenant, code)
        child = self._rpc_children.get(key)
        if child is None:
            child = self._rpc_children[key] = self.rpcs.labels(method, tenant, code)
        child.inc()

    def render(self) -> bytes:
        """The current metrics in the Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, address: str) -> int:
        """Serves ``/metrics`` over HTTP on ``HOST:PORT`` in a daemon thread.

        Returns:
            The port bound (useful with port 0).
        """
        host, _, port = address.rpartition(":")
        server, thread = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        self._http, self._http_thread = server, thread
        return int(server.server_port)

    def close(self) -> None:
        """Stops the HTTP server, if any."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
