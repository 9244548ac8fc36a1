"""The seam between the daemon and where its tenants and registered modules live.

Two stores sit behind it: the embedded store (:mod:`evald.daemon._embedded`: the TOML config's
tenants, modules in the state folder; one machine, nothing beside the daemon) and the fleet
store (:mod:`evald.daemon._fleet`: PostgreSQL, followed by every daemon of a fleet). The daemon
sees either as a :class:`ControlStore`, and each store sees the daemon as a
:class:`StoreDaemon`: what a store does to it (and the metrics it may add to). Both stay off
the evaluation path: a call resolves its evaluator and its tenant from tables the store swaps
in whole, so the hot path costs the same with either store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from evald.daemon._config import Config, TenantConfig
from evald.daemon._metrics import Metrics
from evald.daemon._registry import Registry
from evald.host import CompiledModule, Limits, WasmHost

__all__ = ["ControlStore", "StoreDaemon"]


class StoreDaemon(Protocol):
    """What a store asks of the daemon it feeds."""

    def apply_tenants(self, tenants: Sequence[TenantConfig]) -> None:
        """Serves these tenants from now on (tokens, limits; calls of revoked tokens end)."""
        ...

    def limits_of(self, tenant: str) -> Limits:
        """The host limits ``tenant`` runs under now."""
        ...

    def store_health(self, problem: str | None) -> None:
        """The store became unreachable (``problem`` says why) or reachable again (None)."""
        ...

    @property
    def metrics(self) -> Metrics:
        """The daemon's metrics (the fleet store adds its freshness to their registry)."""
        ...


class ControlStore(Protocol):
    """Where tenants and registered modules live (see the module). Every method but
    :attr:`problem` blocks: the daemon calls them on its control thread."""

    @property
    def kind(self) -> str:
        """``embedded`` or ``postgresql`` (logged at start)."""
        ...

    @property
    def problem(self) -> str | None:
        """Why the store cannot be reached now (None: it can, or needs no reaching)."""
        ...

    def make_registry(
        self, host: WasmHost, compile: Callable[[bytes, int], CompiledModule]
    ) -> Registry:
        """The registry that serves this store's modules and writes registrations to it."""
        ...

    def load(self) -> dict[str, int]:
        """Applies the tenants and starts loading their modules off the control thread (the
        daemon always starts, and serves before they are loaded); returns counts per tenant."""
        ...

    def catch_up(self) -> None:
        """Applies what the store changed that this daemon has not applied yet (before a
        registration commits: a token revoked meanwhile must refuse it).

        Raises:
            EvaldError: ``unavailable`` (the store is unreachable).
        """
        ...

    def reload(self, config: Config) -> None:
        """A live reload: the config file was read again (``SIGHUP``, ``evald reload``)."""
        ...

    def close(self) -> None: ...
