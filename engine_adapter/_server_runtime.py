"""What all evaluated requests of one server process share (SGLang's scheduler, vLLM's engine core).

In SGLang one :class:`AdapterRuntime` hangs off each xgrammar grammar backend (one per scheduler
process); vLLM's adapter keeps one per scheduler:
the tokenizer's :class:`~engine_adapter.TokenCodec` (built once, about a second for a 49k
vocabulary), the evaluator list used to lower ``evaluated_tag``s (cached), and the engine-wide
:class:`~engine_adapter.EvaluatorClient` — one bidirectional stream per process, created on the
first evaluated request, shared by every grammar object and flushed once per decode step.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from engine_adapter._client import EvaluatorClient, list_evaluators
from engine_adapter._grammar import EvaluatorSpec
from engine_adapter._injector import SpanRecord, TokenCodec
from engine_adapter._lowered_spans import EvaluatorsUnavailable
from engine_adapter._server_config import AdapterConfig
from engine_adapter._types import EvalResult

__all__ = [
    "DEFAULT_MAX_TENANTS",
    "AdapterRuntime",
    "TenantRuntimes",
    "close_shared_clients",
    "shared_client",
]

#: How many tenants (evald address and token pairs) one server process evaluates for at most:
#: each has its own connection to evald, so a stream of made-up tokens must not open one each.
DEFAULT_MAX_TENANTS = 256

logger = logging.getLogger("engine_adapter.sglang")

_CLIENTS: dict[tuple[Any, ...], EvaluatorClient] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(config: AdapterConfig) -> EvaluatorClient:
    """The process-wide client for ``config``'s address and credentials (created on first use)."""
    key = (config.target, config.token, config.tls_ca, config.tls_cert, config.tls_key)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = EvaluatorClient(
                config.target,
                config.token or "",
                tls_ca=config.tls_ca,
                tls_cert=config.tls_cert,
                tls_key=config.tls_key,
            )
            _CLIENTS[key] = client
            logger.info("evald adapter: evaluating spans through %s", config.target)
        return client


_INPROCESS: Any = None


def _inprocess_evaluator() -> Any:
    """One in-process WASM host per process (``EVALD_INPROCESS=1``): the standard evaluators."""
    global _INPROCESS
    with _CLIENTS_LOCK:
        if _INPROCESS is None:
            from engine_adapter._inprocess import InProcessWasmEvaluator

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


class AdapterRuntime:
    """The per-backend state of the adapter.

    Parameters:
        config: from :meth:`AdapterConfig.from_env`, with the tenant's target and token.
        codec: the tokenizer's codec (its bytes per token must match the grammar's vocabulary).
        refusal: ``(code, message)`` that every span answers instead of being evaluated (a
            request option the server refused); then nothing connects to evald.
    """

    def __init__(
        self,
        config: AdapterConfig,
        codec: TokenCodec,
        *,
        refusal: tuple[str, str] | None = None,
    ) -> None:
        self.config = config
        self.codec = codec
        self.refusal = refusal
        self._client: EvaluatorClient | None = None
        self._unflushed = False
        self._lock = threading.Lock()
        self._specs: list[EvaluatorSpec] | None = None
        self._specs_at = 0.0
        self._span_log: TextIO | None = None

    @property
    def client(self) -> EvaluatorClient:
        """The process-wide evald client (created, and connected, on first use); with
        ``EVALD_INPROCESS=1`` the process's in-process WASM host instead."""
        client = self._client
        if client is None:
            client = self._client = (
                _inprocess_evaluator() if self.config.inprocess else shared_client(self.config)
            )
        return client

    # The runtime is the injectors' SpanEvaluator: it forwards to the shared client and
    # remembers whether anything was submitted since the last flush, so that the flush every
    # grammar object attempts in fill_vocab_mask costs an attribute read when there is nothing
    # to send (it is called once per evaluated row per decode step).

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        if self.refusal is not None:
            refused: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
            refused.set_result(EvalResult(None, *self.refusal))
            return refused
        future = self.client.submit(evaluator, content, deadline_ms)
        self._unflushed = True
        return future

    def flush(self) -> None:
        """Sends every span submitted since the last flush as one message (if there are any)."""
        if self._unflushed:
            self._unflushed = False
            self.client.flush()

    def evaluators(self, refresh: bool = False) -> Sequence[EvaluatorSpec]:
        """The tenant's evaluators (``ListEvaluators``), reused for ``evaluators_ttl_s``.

        Called from SGLang's grammar-compile threads, never from the decode loop.

        Raises:
            EvaluatorsUnavailable: evald did not answer (the message says why).
        """
        with self._lock:
            fresh = time.monotonic() - self._specs_at < self.config.evaluators_ttl_s
            if self._specs is not None and fresh and not refresh:
                return list(self._specs)
            if self.refusal is not None:
                raise EvaluatorsUnavailable(self.refusal[1])
            try:
                specs = list_evaluators(self.config.target, self.config.token or "", timeout_s=5.0)
            except Exception as exc:  # CallError, or anything the transport raises
                if self._specs is not None and not refresh:
                    logger.warning(
                        "evald adapter: ListEvaluators failed (%s); using the last answer", exc
                    )
                    return list(self._specs)
                raise EvaluatorsUnavailable(
                    f"ListEvaluators at {self.config.target} failed: {exc}"
                ) from None
            self._specs, self._specs_at = specs, time.monotonic()
            return list(specs)

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


class TenantRuntimes:
    """One :class:`AdapterRuntime` per tenant (evald address and token) in a server process.

    Parameters:
        codec: the tokenizer's codec, shared by every tenant.
        limit: at most this many tenants; a further one gets ``None`` (its spans then answer
            ``quota_exceeded``), so that requests with made-up tokens cannot make the
            process open a connection each.

    Thread-safe: SGLang compiles grammars on a thread pool.
    """

    def __init__(self, codec: TokenCodec, *, limit: int = DEFAULT_MAX_TENANTS) -> None:
        self.codec = codec
        self.limit = limit
        self._runtimes: dict[tuple[Any, ...], AdapterRuntime] = {}
        self._lock = threading.Lock()

    def get(self, config: AdapterConfig) -> AdapterRuntime | None:
        """The tenant's runtime (made on first use), or ``None`` past :attr:`limit`."""
        key = (config.target, config.token)
        with self._lock:
            runtime = self._runtimes.get(key)
            if runtime is None:
                if len(self._runtimes) >= self.limit:
                    return None
                runtime = self._runtimes[key] = AdapterRuntime(config, self.codec)
            return runtime

    def refusing(self, config: AdapterConfig, code: str, message: str) -> AdapterRuntime:
        """A runtime whose spans all answer ``code`` (not counted against the limit)."""
        return AdapterRuntime(config, self.codec, refusal=(code, message))

    def __len__(self) -> int:
        with self._lock:
            return len(self._runtimes)
