"""What ``ListEvaluators`` tells a caller: the evaluators its token may call, the daemon's
revision, and which tenant the token is.

The grammar builders want only the evaluators (:func:`list_evaluators`); a client that caches
them wants the revision from the same answer (:func:`evaluator_listing`); a client that holds
many tokens, such as a server process serving many tenants, wants to know which of them are one
tenant (:func:`tenant_listing`, whose :attr:`EvaluatorListing.tenant` is the daemon's name for
the caller's own tenant).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.spans import EvaluatorSpec
from evald.client import Client

__all__ = ["EvaluatorListing", "evaluator_listing", "list_evaluators", "tenant_listing"]


@dataclass(frozen=True)
class EvaluatorListing:
    """One ``ListEvaluators`` answer, as grammar inputs; its parts always belong together."""

    evaluators: list[EvaluatorSpec]
    revision: int
    """The daemon's revision of tenants and modules when it answered."""
    tenant: str
    """The name of the tenant the caller's token authenticates: its own, never another's.
    Empty from a daemon older than ``ListEvaluatorsResponse.tenant``."""


def list_evaluators(
    target: str | None = None,
    token: str | None = None,
    *,
    timeout_s: float = 10.0,
    env_token: bool = True,
) -> list[EvaluatorSpec]:
    """The evaluators a tenant may call, as grammar inputs (``ListEvaluators``).

    Parameters:
        target: ``unix:PATH`` or ``HOST:PORT``; default ``evald.default_target()``.
        token: bearer token; default ``$EVALD_TOKEN``; none for the unix socket's local tenant.

    Raises:
        evald.CallError: the daemon refused (``permission_denied``) or could not be reached
            (``unreachable``).
    """
    with Client(target, token, timeout_s=timeout_s, env_token=env_token) as client:
        return [EvaluatorSpec.from_info(info) for info in client.list_evaluators()]


def tenant_listing(
    target: str,
    token: str | None,
    *,
    timeout_s: float = 5.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> EvaluatorListing:
    """The tenant's evaluators, the daemon's revision and the tenant's name, from one
    ``ListEvaluators`` answer.

    ``token`` None means no token (``$EVALD_TOKEN`` is not read: the caller applied its own
    defaults).

    Raises:
        evald.CallError: refused (``permission_denied``, ``unauthenticated``) or unreachable.
    """
    with Client(
        target,
        token,
        timeout_s=timeout_s,
        env_token=False,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
    ) as client:
        response = client.listing_response()
    return EvaluatorListing(
        [EvaluatorSpec.from_info(info) for info in response.evaluators],
        int(response.revision),
        str(response.tenant),
    )


def evaluator_listing(
    target: str,
    token: str | None,
    *,
    timeout_s: float = 5.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> tuple[list[EvaluatorSpec], int]:
    """``(the tenant's evaluators, the daemon's revision)`` from one ``ListEvaluators`` answer
    (:func:`tenant_listing` without the tenant's name)."""
    listing = tenant_listing(
        target, token, timeout_s=timeout_s, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
    )
    return listing.evaluators, listing.revision
