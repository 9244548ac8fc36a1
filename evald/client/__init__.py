"""evald's blocking clients: :class:`Client` (gRPC) and :class:`DataConnection` (the data path).

They speak the public contract (``evald.contract``) and nothing else: no daemon code is
imported on the client side. The CLI, tools and tests use :class:`Client`; engines use the
streaming ``engine_adapter.EvaluatorClient``, which opens a :class:`DataConnection` when told
to use the data path.
"""

from __future__ import annotations

from evald.client._client import CallError, Client, resolve_endpoint
from evald.client._data_client import DataCallError, DataConnection

__all__ = ["CallError", "Client", "DataCallError", "DataConnection", "resolve_endpoint"]
