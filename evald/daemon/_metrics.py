"""Prometheus metrics of the daemon, on a private registry, served over HTTP when configured.

Labels are bounded: ``tenant`` comes from the config, ``evaluator`` from what a tenant can see
(names that resolve to nothing are counted as ``unknown``, so a client cannot grow the label set),
``outcome`` is ``ok`` or an error code. Latency buckets start at 5 µs because a guest call on a
reused instance takes a few microseconds.

At that scale the metrics themselves cost more than the guest call (a counter and two histogram
observations take three locks and about 3 µs), so the daemon's workers tally their evaluations in
a thread-local table (:meth:`Metrics.tally_evaluation`: a dict lookup and two bisects) and add it
to the shared metrics once per batch, before the batch's last answer goes out, or at the end of
a time slice (:meth:`Metrics.flush_tally`): a caller that has its answers sees them counted, and
a scrape sees an evaluation at most one slice (a few milliseconds) after it finished.
"""

from __future__ import annotations

import functools
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable
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
        self.store_connected = Gauge(
            "evald_store_connected",
            "1 while the daemon reaches its store (always 1 for the embedded store), else 0: "
            "it serves what it has, and registrations answer unavailable.",
            registry=self.registry,
        )
        self.store_connected.set(1)
        self.cpus = Gauge(
            "evald_cpus",
            "How many CPUs evald's workers and compile worker run on; the label lists them "
            "([server] cpus, else every CPU the daemon was given).",
            ("cpus",),
            registry=self.registry,
        )
        self.revision = Gauge(
            "evald_store_revision",
            "The revision of tenants and modules the daemon serves.",
            registry=self.registry,
        )
        # labels() costs a lock and a tuple hash per call: resolve each child once.
        self._evaluation_children: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
        self._rpc_children: dict[tuple[str, str, str], Any] = {}
        self._local = threading.local()  # each worker thread's tally (see tally_evaluation)
        self._latency_bounds = (*LATENCY_BUCKETS_S, math.inf)
        self._fuel_bounds = (*FUEL_BUCKETS, math.inf)
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    def _children(self, key: tuple[str, str, str]) -> tuple[Any, Any, Any]:
        children = self._evaluation_children.get(key)
        if children is None:
            tenant, evaluator, outcome = key
            children = (
                self.evaluations.labels(tenant, evaluator, outcome),
                self.eval_seconds.labels(tenant, evaluator),
                self.fuel.labels(tenant, evaluator),
            )
            self._evaluation_children[key] = children
        return children

    def observe_evaluation(
        self, tenant: str, evaluator: str, outcome: str, elapsed_us: int, fuel_used: int
    ) -> None:
        """Records one finished evaluation."""
        count, seconds, fuel = self._children((tenant, evaluator, outcome))
        count.inc()
        if elapsed_us or fuel_used:
            seconds.observe(elapsed_us / 1e6)
            fuel.observe(fuel_used)

    def tally_evaluation(
        self, tenant: str, evaluator: str, outcome: str, elapsed_us: int, fuel_used: int
    ) -> None:
        """:meth:`observe_evaluation`, deferred: counted in this thread's tally until this
        thread calls :meth:`flush_tally` (no lock, no shared write per evaluation)."""
        if not _BULK_HISTOGRAMS:
            self.observe_evaluation(tenant, evaluator, outcome, elapsed_us, fuel_used)
            return
        try:
            tally: dict[tuple[str, str, str], list[Any]] = self._local.tally
        except AttributeError:
            tally = self._local.tally = {}
        key = (tenant, evaluator, outcome)
        entry = tally.get(key)
        if entry is None:
            latency_buckets = [0] * len(self._latency_bounds)
            entry = tally[key] = [0, 0.0, latency_buckets, 0.0, [0] * len(self._fuel_bounds)]
        entry[0] += 1
        if elapsed_us or fuel_used:
            elapsed_s = elapsed_us / 1e6
            entry[1] += elapsed_s
            entry[2][bisect_left(self._latency_bounds, elapsed_s)] += 1
            entry[3] += fuel_used
            entry[4][bisect_left(self._fuel_bounds, fuel_used)] += 1

    def flush_tally(self) -> None:
        """Adds this thread's tally to the shared metrics and empties it."""
        tally: dict[tuple[str, str, str], list[Any]] | None = getattr(self._local, "tally", None)
        if not tally:
            return
        self._local.tally = {}
        for key, (count, elapsed_s, latency_buckets, fuel_used, fuel_buckets) in tally.items():
            counter, seconds, fuel = self._children(key)
            counter.inc(count)
            _add_to_histogram(seconds, elapsed_s, latency_buckets)
            _add_to_histogram(fuel, fuel_used, fuel_buckets)

    def count_modules(self, tenants: Iterable[str], count: Callable[[str], int]) -> None:
        """``evald_registered_modules`` of each tenant, read at scrape time as ``count(tenant)``
        (it changes as a tenant's stored modules load, off the control thread)."""
        for tenant in tenants:
            self.modules.labels(tenant).set_function(functools.partial(count, tenant))

    def forget_evaluator(self, tenant: str, evaluator: str) -> None:
        """Removes every series of one of ``tenant``'s evaluators (it was deleted): without
        this, each name ever registered kept its 35 series (2.7 KiB) for the daemon's life."""
        self._forget(lambda key: key[0] == tenant and key[1] == evaluator)

    def forget_tenant(self, tenant: str) -> None:
        """Removes every series of a tenant that is no longer served (removed by a reload or
        the store)."""
        self._forget(lambda key: key[0] == tenant)
        for key in [key for key in self._rpc_children if key[1] == tenant]:
            self._rpc_children.pop(key, None)
            _remove(self.rpcs, key)
        _remove(self.inflight, (tenant,))
        _remove(self.modules, (tenant,))

    def _forget(self, matches: Callable[[tuple[str, str, str]], bool]) -> None:
        """Removes the evaluation series whose ``(tenant, evaluator, outcome)`` ``matches``.
        A worker's tally not flushed yet may add one back (at most one slice's worth)."""
        for key in [key for key in list(self._evaluation_children) if matches(key)]:
            self._evaluation_children.pop(key, None)
            _remove(self.evaluations, key)
            _remove(self.eval_seconds, key[:2])
            _remove(self.fuel, key[:2])

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


def _remove(metric: Any, labels: tuple[str, ...]) -> None:
    """Removes one labelled series; none is fine (removed already, or never observed)."""
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def _add_to_histogram(child: Any, total: float, bucket_counts: list[int]) -> None:
    """Adds ``bucket_counts`` observations summing to ``total`` to a histogram child at once.

    prometheus_client has no bulk observe; its histogram child keeps one value per bucket (not
    cumulative) and a sum, which ``observe`` increments: this does the same increments, once
    per bucket instead of once per observation (the layout is checked once, by
    :func:`_bulk_histograms`; prometheus-client is pinned).
    """
    if not any(bucket_counts):
        return
    child._sum.inc(total)
    for bucket, count in zip(child._buckets, bucket_counts, strict=True):
        if count:
            bucket.inc(count)


def _bulk_histograms() -> bool:
    """Whether this prometheus_client's histograms have the layout ``_add_to_histogram`` uses."""
    probe = Histogram("probe", "probe", ("x",), buckets=(1.0,), registry=CollectorRegistry())
    child = probe.labels("x")
    buckets = getattr(child, "_buckets", None)
    return (
        isinstance(buckets, list)
        and len(buckets) == 2
        and all(hasattr(bucket, "inc") for bucket in buckets)
        and hasattr(getattr(child, "_sum", None), "inc")
        and tuple(getattr(child, "_upper_bounds", ())) == (1.0, math.inf)
    )


_BULK_HISTOGRAMS = _bulk_histograms()
