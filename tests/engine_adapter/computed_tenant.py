"""The per-request tenant of the servers' computed-fields tests (SGLang's and vLLM's alike)."""

from __future__ import annotations

import json
from typing import Any

from engine_adapter.testing import ECHO, POLICY, VERDICT
from evald.client import Client
from evald.testing import named_guest


def register_policy(target: str, owner_token: str, other_token: str) -> list[Any]:
    """``ECHO`` and ``POLICY`` for ``owner_token``'s tenant only (``other_token``'s does not
    see them); the owner's evaluators."""
    from engine_adapter import list_evaluators

    with Client(target, owner_token) as client:
        client.register(named_guest("echo", ECHO), replace=True)
        verdict = (json.dumps(VERDICT).encode(), False)
        client.register(named_guest("payload", POLICY, verdict), replace=True)
    assert POLICY not in {s.name for s in list_evaluators(target, other_token)}
    return list_evaluators(target, owner_token)
