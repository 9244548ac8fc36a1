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

__all__ = ["AdapterRuntime", "close_shared_clients", "shared_client"]

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
        config: from :meth:`AdapterConfig.from_env`.
        codec: the tokenizer's codec (its bytes per token must match the grammar's vocabulary).
    """

    def __init__(self, config: AdapterConfig, codec: TokenCodec) -> None:
        self.config = config
        self.codec = codec
        self._client: EvaluatorClient | None = None
        self._unflushed = False
        self._lock = threading.Lock()
        self._specs: list[EvaluatorSpec] | None = None
        self._specs_at = 0.0
        self._span_log: TextIO | None = None

    @property
    def client(self) -> EvaluatorClient:
        """The process-wide evald client (created, and connected, on first use)."""
        client = self._client
        if client is None:
            client = self._client = shared_client(self.config)
        return client

    # The runtime is the injectors' SpanEvaluator: it forwards to the shared client and
    # remembers whether anything was submitted since the last flush, so that the flush every
    # grammar object attempts in fill_vocab_mask costs an attribute read when there is nothing
    # to send (it is called once per evaluated row per decode step).

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
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

    def log_span(self, record: SpanRecord, key: str | None) -> None:
        """Appends one finished span to ``EVALD_SPAN_LOG`` (no-op when unset)."""
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
                "at": time.time(),
            },
            ensure_ascii=False,
        )
        with self._lock:
            if self._span_log is None:
                self._span_log = open(self.config.span_log, "a", encoding="utf-8")
            self._span_log.write(line + "\n")
            self._span_log.flush()
