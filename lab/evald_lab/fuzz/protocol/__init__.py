"""Protocol abuse: what a hostile or broken client does to the daemon's gRPC surface.

Each scenario sends a few requests, checks what came back and records one input per request:
malformed and oversized messages, batches over ``max_batch_items``, unknown evaluators (empty,
huge, look-alike, control characters), missing, wrong and malformed tokens, another tenant's
module names (evaluate, delete, list, shadow), deadline extremes, huge ids, streams opened and
abandoned mid-work (their quota must come back), many concurrent streams, streams that turn
corrupt halfway; and what a caller can make the daemon hold: large messages without a valid
token (refused from their metadata, never read), streams that never read the amplified output
of ``strop``'s ``replace`` (bounded in bytes, then cut off), and batches whose values add up past
the response limit (every item answered, each typed); what one caller can take from the others
(:mod:`.pools`: the services that need no token, shares of the pools, requests that never
arrive whole). The same classes on the engine data path are in :mod:`.data_path`.

One module per theme: :mod:`.messages` (malformed and extreme requests),
:mod:`.names_and_tokens` (evaluator names, tokens, the other tenant's modules), :mod:`.streams`
(abandoned, many, corrupt), :mod:`.holding` (what a caller can make the daemon hold),
:mod:`.pools` (what one caller can take from the others),
:mod:`.data_path` (the engine data path); :mod:`.raw_calls` holds what they share.
:data:`SCENARIOS` is what a protocol step draws from, each with its weight.

A refusal must carry an ``evald-error-code`` (the daemon's typed errors); the only untyped
statuses accepted are the ones gRPC itself produces before the daemon sees the call (a message or
metadata over the transport's limits), and they are counted as such.
"""

from __future__ import annotations

from evald_lab.fuzz.protocol.data_path import DATA_HOLD_SCENARIOS, DATA_SCENARIOS
from evald_lab.fuzz.protocol.holding import (
    oversized_response,
    unauthenticated_flood,
    unread_streams,
)
from evald_lab.fuzz.protocol.messages import (
    deadline_extremes,
    empty_messages,
    huge_ids,
    malformed_message,
    oversized_batch,
    oversized_message,
)
from evald_lab.fuzz.protocol.names_and_tokens import bad_tokens, foreign_modules, unknown_evaluators
from evald_lab.fuzz.protocol.pools import (
    data_connection_hog,
    hello_churn,
    open_service_flood,
    stalled_frames,
)
from evald_lab.fuzz.protocol.raw_calls import Scenario
from evald_lab.fuzz.protocol.streams import (
    abandoned_streams,
    corrupt_stream,
    inflight,
    many_streams,
)

__all__ = ["HOLD_SCENARIOS", "SCENARIOS", "Scenario", "inflight"]

SCENARIOS: tuple[tuple[str, Scenario, float], ...] = (
    ("malformed_message", malformed_message, 6.0),
    ("oversized_message", oversized_message, 0.3),
    ("oversized_batch", oversized_batch, 0.5),
    ("unknown_evaluators", unknown_evaluators, 3.0),
    ("bad_tokens", bad_tokens, 6.0),
    ("foreign_modules", foreign_modules, 3.0),
    ("deadline_extremes", deadline_extremes, 1.0),
    ("huge_ids", huge_ids, 1.0),
    ("abandoned_streams", abandoned_streams, 0.5),
    ("many_streams", many_streams, 0.5),
    ("corrupt_stream", corrupt_stream, 2.0),
    ("empty_messages", empty_messages, 1.0),
    ("unauthenticated_flood", unauthenticated_flood, 0.3),
    ("unread_streams", unread_streams, 0.3),
    ("oversized_response", oversized_response, 0.3),
    ("open_service_flood", open_service_flood, 0.3),
    ("data_connection_hog", data_connection_hog, 0.3),
    ("hello_churn", hello_churn, 0.1),
    ("stalled_frames", stalled_frames, 0.2),
    *DATA_SCENARIOS,
)
"""Every scenario with its weight (how often a protocol step picks it)."""

#: Run once per run before the main loop (and drawn in it like the others): what a caller can
#: make the daemon hold.
HOLD_SCENARIOS: tuple[Scenario, ...] = (
    unauthenticated_flood,
    unread_streams,
    oversized_response,
    open_service_flood,
    data_connection_hog,
    hello_churn,
    stalled_frames,
    *DATA_HOLD_SCENARIOS,
)
