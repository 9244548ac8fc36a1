"""What every part of a fuzz run shares: the target, the tenants, the checker, the tally, and the
helpers that send evaluations and check every result.

All evaluation traffic goes through :meth:`FuzzContext.send`, which packs items into
``EvaluateBatch`` calls or ``EvaluateStream`` messages as large as the daemon accepts (by item
count and by bytes), checks each result with the :class:`~evald_lab.fuzz.checks.Checker`, and
records its outcome. A call-level failure is recorded against every item it carried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import grpc

from evald.client import CallError, Client
from evald.contract import pb
from evald_lab.fuzz.checks import (
    Canaries,
    Checker,
    Recorder,
    TenantBounds,
    Violation,
    outcome_label,
)

__all__ = ["FuzzContext", "Item", "Secrets"]

#: Room left in a message for everything but the inputs (ids, names, framing).
_MESSAGE_SLACK = 64 * 1024


@dataclass(frozen=True)
class Item:
    """One evaluation to send: evaluator, input, the family it was drawn from, its deadline."""

    evaluator: str
    data: bytes
    family: str = ""
    deadline_ms: int = 0


@dataclass
class Secrets:
    """Names and canaries the scenarios share (filled in by the set-up)."""

    victim_echo: str = ""
    victim_secret: str = ""
    victim_canary: str = ""
    attacker_canary: str = ""
    attacker_loop: str = ""
    attacker_modules: dict[str, object] = field(default_factory=dict)


@dataclass
class FuzzContext:
    """The run's shared state. Thread-safe: lanes call :meth:`send` concurrently."""

    target: str
    tokens: dict[str, str]
    victim: str
    attacker: str
    bounds: dict[str, TenantBounds]
    checker: Checker
    recorder: Recorder
    canaries: Canaries
    threads: int
    max_batch_items: int
    max_message_bytes: int
    margin_ms: float
    metrics_port: int | None = None
    data_target: str | None = None  # the data path (``unix:PATH``), when the daemon has one
    evaluators: dict[str, pb.EvaluatorInfo] = field(default_factory=dict)
    secrets: Secrets = field(default_factory=Secrets)
    stop: threading.Event = field(default_factory=threading.Event)
    _clients: dict[str, Client] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, tenant: str, *, timeout_s: float = 120.0) -> Client:
        """A shared client for ``tenant`` (gRPC channels are thread-safe)."""
        key = f"{tenant}/{timeout_s}"
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = Client(self.target, self.tokens[tenant], timeout_s=timeout_s)
                self._clients[key] = client
            return client

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def metadata(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[tenant]}"),)

    # Sending ---------------------------------------------------------------------------------

    def _chunks(self, requests: list[pb.EvaluateRequest]) -> Iterator[list[pb.EvaluateRequest]]:
        budget = self.max_message_bytes - _MESSAGE_SLACK
        chunk: list[pb.EvaluateRequest] = []
        size = 0
        for request in requests:
            item_size = len(request.input) + len(request.evaluator) + len(request.id) + 16
            if chunk and (len(chunk) >= self.max_batch_items or size + item_size > budget):
                yield chunk
                chunk, size = [], 0
            chunk.append(request)
            size += item_size
        if chunk:
            yield chunk

    def call_bound_s(self, tenant: str, requests: Sequence[pb.EvaluateRequest]) -> float:
        """How long a call carrying ``requests`` may take: every item running to its deadline,
        spread over the daemon's workers, plus a per-item and a fixed margin."""
        bounds = self.bounds[tenant]
        total_ms = sum(bounds.effective_deadline_ms(r.deadline_ms) for r in requests)
        return (total_ms / max(1, self.threads) + 2.0 * len(requests)) / 1000 + 5.0

    def send(
        self,
        klass: str,
        tenant: str,
        items: Sequence[Item],
        *,
        via: Literal["batch", "stream"] = "batch",
        id_prefix: str = "",
    ) -> list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]:
        """Sends ``items`` as ``tenant``, checks and records every result.

        Returns:
            Each request with its matched response (None when the call failed).
        """
        requests = [
            pb.EvaluateRequest(
                evaluator=item.evaluator,
                input=item.data,
                deadline_ms=item.deadline_ms,
                id=f"{id_prefix}{index}",
            )
            for index, item in enumerate(items)
        ]
        families = {request.id: item.family for request, item in zip(requests, items, strict=True)}
        out: list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]] = []
        chunks = list(self._chunks(requests))
        if via == "stream":
            out.extend(self._send_stream(klass, tenant, chunks, families))
        else:
            for chunk in chunks:
                out.extend(self._send_batch(klass, tenant, chunk, families))
        return out

    def _record(
        self,
        klass: str,
        tenant: str,
        requests: list[pb.EvaluateRequest],
        responses: list[pb.EvaluateResponse],
        families: dict[str, str],
        *,
        ordered: bool,
    ) -> list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]:
        violations, matched = self.checker.batch(
            klass, tenant, requests, responses, ordered=ordered
        )
        self.settle(klass, tenant, violations, zip(requests, matched, strict=True))
        for request, response in zip(requests, matched, strict=True):
            label = outcome_label(response) if response is not None else "missing"
            self.recorder.outcome(
                klass,
                label,
                family=families.get(request.id, ""),
                eval_us=response.eval_time_us if response is not None else 0,
            )
        return list(zip(requests, matched, strict=True))

    def settle(
        self,
        klass: str,
        tenant: str,
        violations: Iterable[Violation],
        pairs: Iterable[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]],
    ) -> None:
        """Records ``violations``, except that an evaluation over its deadline bound is repeated
        (alone, up to three times) first: only one that is over every time is an escape."""
        self.recorder.add(v for v in violations if v.kind != "deadline_escape")
        bounds = self.checker.bounds[tenant]
        for request, response in pairs:
            if response is None:
                continue
            self.recorder.overrun(
                klass, response.eval_time_us, bounds.effective_deadline_ms(request.deadline_ms)
            )
            if self.checker.over_deadline(tenant, request, response):
                self._confirm_escape(klass, tenant, request, response)

    def _confirm_escape(
        self,
        klass: str,
        tenant: str,
        request: pb.EvaluateRequest,
        first: pb.EvaluateResponse,
    ) -> None:
        client = self.client(tenant)
        times = [first.eval_time_us]
        for attempt in range(3):
            time.sleep(0.1 * (attempt + 1))
            try:
                again: pb.EvaluateResponse = client._invoke(client._stub.Evaluate, request)
            except CallError:
                continue
            times.append(again.eval_time_us)
            if not self.checker.over_deadline(tenant, request, again):
                self.recorder.stall(klass, first.eval_time_us / 1000)
                return
        self.recorder.add(
            v
            for v in self.checker.evaluation(klass, tenant, request, first)
            if v.kind == "deadline_escape"
        )
        self.recorder.add(
            [Violation("deadline_escape", klass, f"repeated: eval times {times} us", "")]
        )

    def latency(
        self, klass: str, elapsed_s: float, bound_s: float, what: str, again: Callable[[], float]
    ) -> None:
        """A call's wall time against its bound; over it, the call is repeated (up to twice)
        and only a call that is slow every time counts as a hang."""
        if not self.checker.call_latency(klass, elapsed_s, bound_s, what):
            return
        for _ in range(2):
            time.sleep(0.1)
            try:
                repeated = again()
            except CallError:
                continue
            if not self.checker.call_latency(klass, repeated, bound_s, what):
                self.recorder.stall(klass, elapsed_s * 1000)
                return
        self.recorder.add(self.checker.call_latency(klass, elapsed_s, bound_s, what))

    def _call_failed(
        self,
        klass: str,
        requests: list[pb.EvaluateRequest],
        families: dict[str, str],
        error: CallError,
        elapsed_s: float,
    ) -> list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]:
        code = error.code.value if error.code is not None else "unreachable"
        violations: list[Violation] = []
        if error.code is None:
            kind = "hang" if elapsed_s >= 1.0 else "crash"
            violations.append(
                Violation(kind, klass, f"a call of {len(requests)} items failed: {error.message}")
            )
        else:
            violations.extend(self.checker.call_error(klass, code, error.message, expected=()))
            violations.append(
                Violation(
                    "unexpected",
                    klass,
                    f"a well-formed call of {len(requests)} items was refused: {error}",
                )
            )
        self.recorder.add(violations)
        for request in requests:
            self.recorder.outcome(klass, f"call:{code}", family=families.get(request.id, ""))
        return [(request, None) for request in requests]

    def _send_batch(
        self,
        klass: str,
        tenant: str,
        requests: list[pb.EvaluateRequest],
        families: dict[str, str],
    ) -> list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]:
        bound_s = self.call_bound_s(tenant, requests)
        client = self.client(tenant, timeout_s=bound_s + 30.0)
        started = time.monotonic()
        try:
            response: pb.EvaluateBatchResponse = client._invoke(
                client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=requests)
            )
        except CallError as error:
            return self._call_failed(klass, requests, families, error, time.monotonic() - started)
        elapsed = time.monotonic() - started
        self.recorder.call(klass, elapsed * 1000)

        def again() -> float:
            began = time.monotonic()
            client._invoke(client._stub.EvaluateBatch, pb.EvaluateBatchRequest(items=requests))
            return time.monotonic() - began

        self.latency(klass, elapsed, bound_s, f"a batch of {len(requests)}", again)
        return self._record(klass, tenant, requests, list(response.results), families, ordered=True)

    def _send_stream(
        self,
        klass: str,
        tenant: str,
        chunks: list[list[pb.EvaluateRequest]],
        families: dict[str, str],
    ) -> list[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]]:
        requests = [request for chunk in chunks for request in chunk]
        if not requests:
            return []
        bound_s = self.call_bound_s(tenant, requests)
        client = self.client(tenant, timeout_s=bound_s + 30.0)
        started = time.monotonic()
        try:
            responses = client.evaluate_stream(chunks, timeout_s=bound_s + 30.0)
        except CallError as error:
            return self._call_failed(klass, requests, families, error, time.monotonic() - started)
        elapsed = time.monotonic() - started
        self.recorder.call(klass, elapsed * 1000)

        def again() -> float:
            began = time.monotonic()
            client.evaluate_stream(chunks, timeout_s=bound_s + 30.0)
            return time.monotonic() - began

        self.latency(klass, elapsed, bound_s, f"a stream of {len(requests)}", again)
        return self._record(klass, tenant, requests, responses, families, ordered=False)

    def raw_call_error(self, error: grpc.RpcError) -> tuple[str | None, grpc.StatusCode, str]:
        """(evald code or None, gRPC status, details) of a failed raw call."""
        code: str | None = None
        for key, value in getattr(error, "trailing_metadata", lambda: ())() or ():
            if key == "evald-error-code":
                code = str(value)
        status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else "") or ""
        return code, status, details
