"""How a request's tenant travels from SGLang's scheduler to its grammar compile, and keeps its
grammar its own.

A request names its tenant in ``SamplingParams.custom_params`` (``evald_token``, ``evald_target``,
``evald_evaluators``); :class:`~engine_adapter.serving.TenantRuntimes` decides which
runtime evaluates it. SGLang caches compiled grammars by ``(kind, key string)`` alone, and a
grammar object carries the runtime it evaluates with, so a tenant's grammar must never be the
cached answer to another tenant's request, nor a grammar lowered from an evaluator spec the
daemon has since replaced. The scheduler hook (``GrammarManager.process_req_with_grammar``):

1. takes the options out of ``custom_params`` (the token stays in the scheduler's memory and
   never reaches a log line or a metric label);
2. asks ``TenantRuntimes.for_request`` for the runtime (never blocks);
3. while SGLang computes the request's cache key, appends :data:`TENANT_MARK` and a mark naming
   the runtime, its spec revision, the request's evaluator renames and its operands text to
   its structural tag, or to its ``json_schema`` when that has computed properties
   (:mod:`engine_adapter.sglang._computed_json`): two tenants, or one tenant before and after
   a revision, have two keys, two compiles and two grammar objects.

The mark resolves to the request's :class:`KeyedTenant` through :class:`TenantKeys`, which holds
it *weakly*: the request itself holds it (``Req._evald_tenant``), so it lives exactly as long as
a request or a compiled grammar needs it, and no flood of other requests can push it out before
the grammar compiles. The compile hooks (``dispatch_structural_tag``, ``dispatch_json``) split
the mark off again (:func:`split_key`). A request whose tag or schema already holds the mark is
refused: only the adapter may write it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_adapter.serving import (
    EXTRA_ARG_EVALUATORS,
    EXTRA_ARG_OPERANDS,
    EXTRA_ARGS,
    AdapterRuntime,
    rename_bindings,
)
from engine_adapter.spans import SpanBinding

__all__ = ["REQUEST_ATTR", "TENANT_MARK", "KeyedTenant", "TenantKeys", "split_key", "take_options"]

#: Separates a structural tag from the tenant mark in SGLang's grammar cache key. JSON text
#: never ends with it, so a key with the mark cannot be a request's own tag.
TENANT_MARK = "\n#evald-tenant="
#: The ``Req`` attribute that keeps a request's :class:`KeyedTenant` alive.
REQUEST_ATTR = "_evald_tenant"


def take_options(custom_params: Any) -> tuple[dict[str, Any] | None, Any]:
    """``(the adapter's options, custom_params without them)``; ``(None, custom_params)`` when
    the request sets none."""
    if not isinstance(custom_params, Mapping) or not any(k in custom_params for k in EXTRA_ARGS):
        return None, custom_params
    options = {key: custom_params[key] for key in EXTRA_ARGS if key in custom_params}
    rest = {key: value for key, value in custom_params.items() if key not in EXTRA_ARGS}
    return options, (rest or None)


def split_key(key_string: str) -> tuple[str, str | None]:
    """``(structural tag, tenant mark or None)`` of a cache key string."""
    tag, mark, found = key_string.rpartition(TENANT_MARK)
    if not mark:
        return key_string, None
    return tag, found


@dataclass(eq=False)
class KeyedTenant:
    """A request's tenant as its grammar sees it: the runtime and the evaluator renames."""

    runtime: AdapterRuntime
    evaluators: str | None
    """The request's ``evald_evaluators`` (already validated), or None."""
    operands_from: str | None = None
    """The request's ``evald_operands_from``: the text its JSON schema's ``extracted``
    properties are narrowed to (part of the key: it changes the grammar)."""

    def bindings(self, found: tuple[SpanBinding, ...]) -> tuple[SpanBinding, ...]:
        if self.evaluators is None:
            return found
        return rename_bindings(found, self.evaluators) or found


class TenantKeys:
    """Cache-key marks to :class:`KeyedTenant`, held weakly (one scheduler process).

    A mark is the runtime's random id, its spec revision and a salted digest of the renames and
    the operands text, so
    it can be neither reversed into a token nor guessed to reach another tenant's grammar.
    """

    def __init__(self) -> None:
        self._salt = os.urandom(16)
        self._by_mark: weakref.WeakValueDictionary[str, KeyedTenant] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def key(
        self, runtime: AdapterRuntime, options: Mapping[str, Any] | None
    ) -> tuple[str, KeyedTenant]:
        """``(mark, the KeyedTenant the request must hold)`` for a request of ``runtime``."""
        renames = options.get(EXTRA_ARG_EVALUATORS) if options is not None else None
        names = renames if isinstance(renames, str) else None
        text = options.get(EXTRA_ARG_OPERANDS) if options is not None else None
        operands = text if isinstance(text, str) else None
        digest = hashlib.blake2b(
            repr((names, operands)).encode(), key=self._salt, digest_size=6
        ).hexdigest()
        mark = f"{runtime.mark}.{runtime.revision}.{digest}"
        with self._lock:
            keyed = self._by_mark.get(mark)
            if keyed is None:
                keyed = KeyedTenant(runtime, names, operands)
                self._by_mark[mark] = keyed
        return mark, keyed

    def find(self, mark: str) -> KeyedTenant | None:
        with self._lock:
            return self._by_mark.get(mark)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_mark)
