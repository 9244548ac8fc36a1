"""Which tenant an SGLang request is evaluated for, and how its grammar stays its own.

A request names its tenant in ``SamplingParams.custom_params`` (``evald_token``, ``evald_target``,
``evald_evaluators``; read by :mod:`engine_adapter._request_options`). SGLang caches compiled
grammars by ``(kind, key string)`` alone, and a grammar object carries the client it evaluates
with, so a tenant's grammar must never be the cached answer to another tenant's request. The
scheduler hook (``GrammarManager.process_req_with_grammar``) therefore:

1. takes the options out of ``custom_params`` (the token stays in the scheduler's memory and
   never reaches a log line or a metric label);
2. keeps them in this process's :class:`TenantTable` under a salted fingerprint;
3. while SGLang computes the request's cache key, appends :data:`TENANT_MARK` and the
   fingerprint to the structural tag: requests of two tenants have two keys, two compiles and
   two grammar objects, each bound to its own tenant's client.

The compile hook (``dispatch_structural_tag``) splits the mark off again (:func:`split_key`),
lowers the tag with that tenant's evaluators and evaluates its spans with its token. A request
whose tag already holds the mark is refused: only the adapter may write it.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Mapping
from typing import Any

from engine_adapter._request_options import EXTRA_ARGS, has_request_options

__all__ = ["TENANT_MARK", "TenantTable", "split_key", "take_options"]

#: Separates a structural tag from the tenant fingerprint in SGLang's grammar cache key. JSON
#: text never ends with it, so a key with the mark cannot be a request's own tag.
TENANT_MARK = "\n#evald-tenant="

#: Fingerprints kept at most; one is needed only until its request's grammar is compiled.
TABLE_SIZE = 4096


def take_options(custom_params: Any) -> tuple[dict[str, Any] | None, Any]:
    """``(the adapter's options, custom_params without them)``; ``(None, custom_params)`` when
    the request sets none."""
    if not isinstance(custom_params, Mapping) or not has_request_options(custom_params):
        return None, custom_params
    options = {key: custom_params[key] for key in EXTRA_ARGS if key in custom_params}
    rest = {key: value for key, value in custom_params.items() if key not in EXTRA_ARGS}
    return options, (rest or None)


def split_key(key_string: str) -> tuple[str, str | None]:
    """``(structural tag, tenant fingerprint or None)`` of a cache key string."""
    tag, mark, fingerprint = key_string.rpartition(TENANT_MARK)
    if not mark:
        return key_string, None
    return tag, fingerprint


class TenantTable:
    """The options of recent tenant requests, by salted fingerprint (one scheduler process).

    The fingerprint is a keyed hash of the options (the salt is random per process), so it can
    be neither reversed into a token nor guessed to reach another tenant's cached grammar.
    """

    def __init__(self, *, size: int = TABLE_SIZE) -> None:
        self._salt = os.urandom(16)
        self._size = size
        self._options: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def fingerprint(self, options: Mapping[str, Any]) -> str:
        """Remembers ``options`` and returns their fingerprint."""
        digest = hashlib.blake2b(key=self._salt, digest_size=16)
        for key in EXTRA_ARGS:
            digest.update(repr((key, options.get(key))).encode())
        fingerprint = digest.hexdigest()
        with self._lock:
            self._options[fingerprint] = dict(options)
            self._options.move_to_end(fingerprint)
            while len(self._options) > self._size:
                self._options.popitem(last=False)
        return fingerprint

    def options(self, fingerprint: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._options.get(fingerprint)
            return dict(found) if found is not None else None
