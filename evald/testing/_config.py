"""Config text for a test daemon: one ``[[tenants]]`` table at a time.

A test or a benchmark writes the config its daemon runs with; the token is stored hashed, as in
a real config (:func:`evald.daemon.hash_token`), so the text is what an operator would write.
"""

from __future__ import annotations

import json
from typing import Any

from evald.daemon import hash_token

__all__ = ["tenant_table"]


def tenant_table(name: str, *, token: str | None = None, **settings: Any) -> str:
    """One ``[[tenants]]`` table for ``name``.

    Parameters:
        token: the tenant's bearer token (written as ``token_sha256``); None for a token-less
            tenant (the unix socket's ``local`` tenant).
        settings: the table's other keys (``evaluators=["*"]``, ``allow_register=True``, …);
            ``limits`` is a dict written as ``[tenants.limits]``.
    """
    limits: dict[str, Any] = settings.pop("limits", {})
    lines = ["[[tenants]]", f'name = "{name}"']
    if token is not None:
        lines.append(f'token_sha256 = "{hash_token(token)}"')
    for key, value in settings.items():
        lines.append(f"{key} = {json.dumps(value)}")
    if limits:
        lines.append("[tenants.limits]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in limits.items())
    return "\n".join(lines) + "\n"
