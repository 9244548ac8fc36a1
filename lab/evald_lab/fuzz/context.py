"""What every part of a fuzz run shares: the target, the tenants, the checker, the tally, and the
one way evaluations are sent.

All evaluation traffic goes through :meth:`FuzzContext.send`, which packs items into
``EvaluateBatch`` calls or ``EvaluateStream`` messages as large as the daemon accepts
(:mod:`.sending`), checks each result with the :class:`~evald_lab.fuzz.checks.Checker` and
records its outcome (:mod:`.settling`). A call-level failure is recorded against every item it
carried.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from evald.client import Client
from evald.contract import pb
from evald_lab.fuzz.checks import Canaries, Checker, TenantBounds, Violation
from evald_lab.fuzz.sending import chunked, send_batch, send_stream
from evald_lab.fuzz.settling import check_latency, settle
from evald_lab.fuzz.tally import Recorder

__all__ = ["FuzzContext", "Item", "Secrets"]


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
    fresh: bool = False  # the daemon runs ``isolation = "fresh"``: no call sees an earlier one
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

    # Sending (the bodies live in :mod:`.sending` and :mod:`.settling`) ----------------------

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
        chunks = list(
            chunked(
                requests,
                max_items=self.max_batch_items,
                max_message_bytes=self.max_message_bytes,
            )
        )
        if via == "stream":
            out.extend(send_stream(self, klass, tenant, chunks, families))
        else:
            for chunk in chunks:
                out.extend(send_batch(self, klass, tenant, chunk, families))
        return out

    def settle(
        self,
        klass: str,
        tenant: str,
        violations: Iterable[Violation],
        pairs: Iterable[tuple[pb.EvaluateRequest, pb.EvaluateResponse | None]],
    ) -> None:
        """Records ``violations``, except that an evaluation over its deadline bound is repeated
        (alone, up to three times) first: only one that is over every time is an escape."""
        settle(self, klass, tenant, violations, pairs)

    def latency(
        self, klass: str, elapsed_s: float, bound_s: float, what: str, again: Callable[[], float]
    ) -> None:
        """A call's wall time against its bound; over it, the call is repeated (up to twice)
        and only a call that is slow every time counts as a hang."""
        check_latency(self, klass, elapsed_s, bound_s, what, again)
