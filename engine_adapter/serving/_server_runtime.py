"""What all evaluated requests of one server process share (SGLang's scheduler, vLLM's engine core).

In SGLang one :class:`AdapterRuntime` hangs off each xgrammar grammar backend (one per scheduler
process); vLLM's adapter keeps one per scheduler:
the tokenizer's :class:`~engine_adapter.TokenCodec` (built once, about a second for a 49k
vocabulary), the evaluator list used to lower ``evaluated_tag``s (cached), and the engine-wide
:class:`~engine_adapter.EvaluatorClient` — one bidirectional stream per process, created on the
first evaluated request, shared by every grammar object and flushed once per decode step.
:func:`answering` tells a tenant check, within a short time, whether evald at an address answers
at all.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_adapter.evaluation import EvaluatorClient, SpanRecord, TokenCodec, evaluator_listing
from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.spans import EvalResult, EvaluatorSpec, EvaluatorsUnavailable
from evald.client import CallError, resolve_endpoint
from evald.contract import CLIENT_MAX_MESSAGE_BYTES, decode_rpc_error

__all__ = [
    "AdapterRuntime",
    "answering",
    "close_shared_clients",
    "shared_client",
]

#: How long a compile thread waits for evald to accept a new tenant's token before lowering
#: (only a compile that was not gated: see :meth:`AdapterRuntime.listing_ready`).
ADMISSION_WAIT_S = 5.0
#: A ListEvaluators answer, or its failure, this recent answers for the next one asked for.
LISTING_MEMORY_S = 1.0

logger = logging.getLogger("engine_adapter.sglang")

_CLIENTS: dict[tuple[Any, ...], EvaluatorClient] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(config: AdapterConfig) -> EvaluatorClient:
    """The process-wide client for ``config``'s address and credentials (created on first use)."""
    key = (config.target, config.token, config.tls_ca, config.tls_cert, config.tls_key)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _new_client(config)
            _CLIENTS[key] = client
            logger.info("evald adapter: evaluating spans through %s", config.target)
        return client


def _new_client(config: AdapterConfig) -> EvaluatorClient:
    return EvaluatorClient(
        config.target,
        config.token,
        tls_ca=config.tls_ca,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        env_token=False,
    )


_INPROCESS: Any = None


def _inprocess_evaluator() -> Any:
    """One in-process WASM host per process (``EVALD_INPROCESS=1``): the standard evaluators."""
    global _INPROCESS
    with _CLIENTS_LOCK:
        if _INPROCESS is None:
            from engine_adapter.evaluation import InProcessWasmEvaluator

            _INPROCESS = InProcessWasmEvaluator(threads=2)
            logger.warning(
                "evald adapter: EVALD_INPROCESS=1, spans are evaluated inside this process "
                "(no tenant isolation; for measurements only)"
            )
        return _INPROCESS


def close_shared_clients() -> None:
    """Closes every shared client (tests, interpreter shutdown); the next use reconnects."""
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        client.close()


@contextlib.contextmanager
def answering(
    target: str,
    timeout_s: float,
    *,
    abandon: threading.Event | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Iterator[None]:
    """Enters once evald at ``target`` has answered a probe within ``timeout_s``.

    gRPC's call deadline cannot tell "nobody answers the connection" (an address that accepts
    and never answers, or a hung evald) from "this call is slow"; the probe asks the one
    question every evald answers at once and without a token, a health ``Check``, so such an
    address costs its caller ``timeout_s`` (short) rather than a whole call timeout. The
    probe's channel stays open inside the block, and a :class:`~evald.client.Client` opened
    there for the same address (same channel arguments) is given its connection rather than a
    new one (over TCP, measured: a probe and a check open one connection); it is closed after
    the block, so no gRPC reconnect backoff outlives it (a channel kept open across an outage
    would refuse calls for as long as its backoff, up to two minutes, after evald is back).

    Raises:
        evald.CallError: unreachable: refused, no answer within ``timeout_s``, or ``abandon``
            set (its owner is closing) while waiting.
    """
    endpoint = resolve_endpoint(
        target, None, env_token=False, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
    )
    channel = endpoint.channel(max_message_bytes=CLIENT_MAX_MESSAGE_BYTES)
    try:
        probe = health_pb2_grpc.HealthStub(channel).Check.future(
            health_pb2.HealthCheckRequest(), timeout=timeout_s
        )
        _probe_answer(probe, endpoint.target, timeout_s, abandon)
        yield
    finally:
        channel.close()


def _probe_answer(
    probe: Any, target: str, timeout_s: float, abandon: threading.Event | None
) -> None:
    """Waits for the probe's answer (any answer: evald is there), looking at ``abandon``."""
    while True:
        try:
            probe.result(timeout=_ABANDON_POLL_S)
            return
        except grpc.FutureTimeoutError:
            if abandon is not None and abandon.is_set():
                probe.cancel()
                raise CallError(None, "the check was abandoned", target=target) from None
        except grpc.RpcError as error:
            failure = decode_rpc_error(error)
            if failure.code is not None or failure.status not in _NO_ANSWER:
                return  # refused, but by something that answers
            message = (
                f"evald at {target} did not connect within {timeout_s:g} s"
                if failure.status == grpc.StatusCode.DEADLINE_EXCEEDED
                else f"evald at {target} is not reachable: {failure.details}"
            )
            raise CallError(None, message, target=target) from None


#: How often a probe looks at its ``abandon`` event.
_ABANDON_POLL_S = 0.1
#: What a probe that got no answer ends with.
_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class AdapterRuntime:
    """The per-tenant state of the adapter in one server process.

    Parameters:
        config: from :meth:`AdapterConfig.from_env`, with the tenant's target and token.
        codec: the tokenizer's codec (its bytes per token must match the grammar's vocabulary).
        refusal: ``(code, message)`` that every span answers instead of being evaluated (a
            request option the server refused); then nothing connects to evald.
        admission: for a tenant whose token evald has not accepted yet
            (:class:`~engine_adapter.serving._tenant_runtimes.TenantRuntimes`): done when it has, or
            when it refused (then :attr:`refusal` is set first). Spans submitted before wait
            for it without blocking the caller.
        own_client: connect with a client of its own, closed by :meth:`retire` (tenant
            runtimes), instead of the process-wide one for this address and token.
    """

    def __init__(
        self,
        config: AdapterConfig,
        codec: TokenCodec,
        *,
        refusal: tuple[str, str] | None = None,
        admission: concurrent.futures.Future[None] | None = None,
        own_client: bool = False,
    ) -> None:
        self.config = config
        self.codec = codec
        self.refusal = refusal
        self.mark = secrets.token_hex(8)
        """Names this runtime in SGLang's grammar cache keys (random: unguessable)."""
        self.revision = 0
        """The daemon's revision of the evaluator specs held (0: none fetched yet)."""
        self.last_used = time.monotonic()
        self._admission = admission
        self._own_client = own_client
        self._client: EvaluatorClient | None = None
        self._unflushed = False
        self._lock = threading.Lock()
        self._specs: list[EvaluatorSpec] | None = None
        self._specs_at = 0.0
        self._failed: tuple[float, str] | None = None
        self._listing: concurrent.futures.Future[None] | None = None
        self._span_log: TextIO | None = None

    @property
    def client(self) -> EvaluatorClient:
        """The evald client (created, and connected, on first use); with
        ``EVALD_INPROCESS=1`` the process's in-process WASM host instead."""
        client = self._client
        if client is None:
            if self.config.inprocess:
                client = _inprocess_evaluator()
            elif self._own_client:
                with self._lock:
                    client = self._client = self._client or _new_client(self.config)
            else:
                client = shared_client(self.config)
            self._client = client
        return client

    @property
    def deadline_ms(self) -> int:
        """Per span (``EVALD_DEADLINE_MS``): with the codec and :meth:`flush`, what makes the
        runtime an ``engine_adapter.evaluation.EngineRuntime``."""
        return self.config.deadline_ms

    @property
    def admitted(self) -> bool:
        """Whether evald has answered for this tenant (accepted, or refused: see refusal)."""
        return self._admission is None or self._admission.done()

    def admit(self, specs: Sequence[EvaluatorSpec] | None, revision: int) -> None:
        """evald accepted the tenant: keeps its evaluator list, releases waiting spans."""
        if specs is not None:
            self.set_listing(specs, revision)
        if self._admission is not None and not self._admission.done():
            self._admission.set_result(None)

    def refuse(self, code: str, message: str) -> None:
        """evald refused the tenant (or never answered): every span answers ``code``."""
        self.refusal = (code, message)
        if self._admission is not None and not self._admission.done():
            self._admission.set_result(None)

    def set_listing(self, specs: Sequence[EvaluatorSpec], revision: int) -> None:
        """A fresh ``ListEvaluators`` answer (the specs first, then the revision that keys
        grammars built from them)."""
        with self._lock:
            self._specs, self._specs_at = list(specs), time.monotonic()
            self._failed = None
            self.revision = int(revision)

    def retire(self) -> None:
        """Closes the runtime's own client (evicted tenant); a request still holding the
        runtime reconnects on its next span."""
        if not self._own_client:
            return
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # The runtime is the injectors' SpanEvaluator: it forwards to the shared client and
    # remembers whether anything was submitted since the last flush, so that the flush every
    # grammar object attempts in fill_vocab_mask costs an attribute read when there is nothing
    # to send (it is called once per evaluated row per decode step).

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        admission = self._admission
        if admission is not None and not admission.done():
            waiting: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
            admission.add_done_callback(
                lambda _: self._forward(waiting, evaluator, content, deadline_ms)
            )
            return waiting
        if self.refusal is not None:
            refused: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
            refused.set_result(EvalResult(None, *self.refusal))
            return refused
        future = self.client.submit(evaluator, content, deadline_ms)
        self._unflushed = True
        return future

    def _forward(
        self,
        waiting: concurrent.futures.Future[EvalResult],
        evaluator: str,
        content: str,
        deadline_ms: int,
    ) -> None:
        """Sends a span that waited for the tenant's admission (on the checking thread)."""
        try:
            if self.refusal is not None:
                waiting.set_result(EvalResult(None, *self.refusal))
                return
            sent = self.client.submit(evaluator, content, deadline_ms)
            self.client.flush()
            sent.add_done_callback(lambda done: waiting.set_result(done.result()))
        except Exception as exc:  # the future never raises
            if not waiting.done():
                waiting.set_result(EvalResult(None, "internal", f"sending the span failed: {exc}"))

    def flush(self) -> None:
        """Sends every span submitted since the last flush as one message (if there are any)."""
        if self._unflushed:
            self._unflushed = False
            self.client.flush()

    def listing_ready(self) -> concurrent.futures.Future[None] | None:
        """Done once :meth:`evaluators` can answer without asking evald; ``None`` when it can
        now (the specs are held, or the tenant is refused).

        SGLang's scheduler hook submits a grammar compile only once this is done
        (:mod:`engine_adapter.sglang._compile_gate`), so a compile never holds one of SGLang's
        compile threads while evald answers: a tenant evald has not accepted yet waits for its
        admission; a runtime that holds no specs yet starts one listing in the background.
        """
        admission = self._admission
        if admission is not None and not admission.done():
            return admission
        with self._lock:
            if self.refusal is not None or self._specs is not None:
                return None
        if self._recent_failure(time.monotonic()) is not None:
            return None  # evaluators() answers with it at once
        return self._list_in_background()

    def evaluators(self, refresh: bool = False) -> Sequence[EvaluatorSpec]:
        """The tenant's evaluators (``ListEvaluators``).

        Called from SGLang's grammar-compile threads, never from the decode loop. Held specs are
        answered at once, however old: past ``evaluators_ttl_s`` a listing starts in the
        background (a tenant runtime's refresher keeps them current sooner, on a revision
        change), so a slow or stopped evald never holds a compile thread. Only a runtime that
        holds no specs, or ``refresh`` (an unknown evaluator name: maybe registered since), asks
        evald here, and a listing that failed or answered less than :data:`LISTING_MEMORY_S`
        ago answers for it. For a tenant evald has not answered for yet it waits up to
        :data:`ADMISSION_WAIT_S` (a compile the scheduler hook gated never does).

        Raises:
            EvaluatorsUnavailable: evald did not answer, or refused (the message says why).
        """
        admission = self._admission
        if admission is not None and not admission.done():
            try:
                admission.result(timeout=ADMISSION_WAIT_S)
            except concurrent.futures.TimeoutError:
                raise EvaluatorsUnavailable(
                    f"unavailable: evald did not answer for this tenant within "
                    f"{ADMISSION_WAIT_S:g} s"
                ) from None
        now = time.monotonic()
        with self._lock:
            if self.refusal is not None:
                raise EvaluatorsUnavailable(f"{self.refusal[0]}: {self.refusal[1]}")
            held, age = self._specs, now - self._specs_at
        failed = self._recent_failure(now)
        if held is not None and not (refresh and age >= LISTING_MEMORY_S and failed is None):
            if age >= self.config.evaluators_ttl_s and failed is None:
                self._list_in_background()
            return list(held)
        if failed is not None:
            raise EvaluatorsUnavailable(failed[1])
        return self._list_now()

    def _recent_failure(self, now: float) -> tuple[float, str] | None:
        """The last listing's failure, while it answers for the next (LISTING_MEMORY_S)."""
        with self._lock:
            failed = self._failed
        return failed if failed is not None and now - failed[0] < LISTING_MEMORY_S else None

    def _list_now(self) -> list[EvaluatorSpec]:
        """Asks evald for the tenant's evaluators (ListEvaluators) and keeps the answer."""
        try:
            specs, revision = evaluator_listing(
                self.config.target,
                self.config.token,
                tls_ca=self.config.tls_ca,
                tls_cert=self.config.tls_cert,
                tls_key=self.config.tls_key,
            )
        except Exception as exc:  # CallError, or anything the transport raises
            message = f"ListEvaluators at {self.config.target} failed: {exc}"
            with self._lock:
                self._failed = (time.monotonic(), message)
            raise EvaluatorsUnavailable(message) from None
        self.set_listing(specs, revision)
        return list(specs)

    def _list_in_background(self) -> concurrent.futures.Future[None]:
        """One listing at a time, on a thread of its own; done when it has answered."""
        with self._lock:
            if self._listing is not None:
                return self._listing
            listing = self._listing = concurrent.futures.Future()
        threading.Thread(
            target=self._background_listing, args=(listing,), name="evald-listing", daemon=True
        ).start()
        return listing

    def _background_listing(self, listing: concurrent.futures.Future[None]) -> None:
        try:
            self._list_now()
        except EvaluatorsUnavailable as exc:
            logger.warning("evald adapter: %s; the held evaluator list is kept", exc)
        except Exception:  # the listing thread must always release what waits for it
            logger.exception("evald adapter: listing the tenant's evaluators failed")
        finally:
            with self._lock:
                self._listing = None
            listing.set_result(None)

    def log_span(self, record: SpanRecord, *, forwards: int | None = None) -> None:
        """Appends one finished span to ``EVALD_SPAN_LOG`` (no-op when unset).

        ``forwards``: how many forward passes carried the span's result tokens, where the
        engine knows (SGLang: 1 when the whole region went in at once).
        """
        if self.config.span_log is None:
            return
        line = json.dumps(
            {
                "evaluator": record.evaluator,
                "content": record.content,
                "value": record.value,
                "error": record.error_code,
                "latency_ms": record.latency_ms,
                "waited_ms": record.waited_s * 1000.0,
                "eval_time_us": record.result.eval_time_us if record.result else None,
                "forwards": forwards,
                "at": time.time(),
            },
            ensure_ascii=False,
        )
        with self._lock:
            if self._span_log is None:
                self._span_log = open(self.config.span_log, "a", encoding="utf-8")
            self._span_log.write(line + "\n")
            self._span_log.flush()
