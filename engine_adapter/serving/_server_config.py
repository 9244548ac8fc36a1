"""The server adapters' settings (SGLang and vLLM), read from the environment of every process.

Both servers start their scheduler / engine-core processes with *spawn*, so nothing configured in
the launching process carries over except the environment: that is why the adapters are
configured by variables, not by an API call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from evald.contract import env_target, env_token, token_problem

__all__ = ["DEFAULT_DEADLINE_MS", "AdapterConfig", "ConfigError"]

#: Per span, from the moment it closes until its value must be known; past it the span ends with
#: ``deadline_exceeded``. Its request sits out the engine's steps meanwhile (the rest of the batch
#: never waits for it), so this bounds what a hung evald or a slow evaluator costs that request
#: alone; evaluations take microseconds to a few ms.
DEFAULT_DEADLINE_MS = 500


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the variable and what it expects."""


@dataclass(frozen=True)
class AdapterConfig:
    """Where evald is and how long a span may take.

    Environment variables (read by :meth:`from_env`):

    - ``EVALD_TARGET`` (required to enable the adapter): ``unix:/run/evald/evald.sock`` or
      ``HOST:PORT``.
    - ``EVALD_TOKEN``: the tenant's bearer token (none: the unix socket's tokenless tenant).
    - ``EVALD_DEADLINE_MS``: per-span deadline (default :data:`DEFAULT_DEADLINE_MS`).
    - ``EVALD_TLS_CA``, ``EVALD_TLS_CERT``, ``EVALD_TLS_KEY``: PEM files for TLS over TCP.
    - ``EVALD_SPAN_LOG``: a file to which every evaluated span is appended as one JSON line
      (evaluator, content, outcome, latency, stall); off by default.
    - ``EVALD_INPROCESS=1``: spans are evaluated inside the server process by the same WASM
      host evald runs, with this package's standard evaluators, instead of by evald (which still
      answers ``ListEvaluators``). No tenant isolation and no process boundary: for measuring
      what isolation costs, never for serving tenants.
    """

    target: str
    token: str | None = field(default=None, repr=False)
    """The server's own tenant token; never in a repr (settings get logged)."""
    deadline_ms: int = DEFAULT_DEADLINE_MS
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    span_log: str | None = None
    inprocess: bool = False
    evaluators_ttl_s: float = 60.0
    """How long a ``ListEvaluators`` answer is reused when lowering ``evaluated_tag``s."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AdapterConfig | None:
        """The settings, or ``None`` when ``EVALD_TARGET`` is unset (the adapter is off).

        Raises:
            ConfigError: a variable is set to something unusable.
        """
        env = os.environ if environ is None else environ
        target = env_target(env)
        if not target:
            return None
        raw_deadline = env.get("EVALD_DEADLINE_MS", "").strip()
        deadline_ms = DEFAULT_DEADLINE_MS
        if raw_deadline:
            try:
                deadline_ms = int(raw_deadline)
            except ValueError:
                deadline_ms = 0
            if deadline_ms <= 0:
                raise ConfigError(
                    f"EVALD_DEADLINE_MS={raw_deadline!r}: expected a positive number of "
                    "milliseconds, for example 500"
                )
        tls = {
            name: env.get(f"EVALD_TLS_{name.upper()}", "").strip() or None
            for name in ("ca", "cert", "key")
        }
        if (tls["cert"] is None) != (tls["key"] is None):
            raise ConfigError("EVALD_TLS_CERT and EVALD_TLS_KEY must be set together")
        for name, path in tls.items():
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"EVALD_TLS_{name.upper()}={path!r}: no such file")
        raw_token = env_token(env) or ""
        token: str | None = None
        if raw_token:
            problem = token_problem(raw_token)
            if problem is not None:
                raise ConfigError(
                    f"EVALD_TOKEN {problem}: set it to the tenant's token, or leave it unset "
                    "for the unix socket's token-less tenant"
                )
            token = raw_token
        return cls(
            target=target,
            token=token,
            deadline_ms=deadline_ms,
            tls_ca=tls["ca"],
            tls_cert=tls["cert"],
            tls_key=tls["key"],
            span_log=env.get("EVALD_SPAN_LOG", "").strip() or None,
            inprocess=_flag(env, "EVALD_INPROCESS"),
        )


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{name}={raw!r}: expected 1 or 0")
