"""What fuzzing and reviews found and the daemon now does: the report's ``hardening`` list.

Each entry has a regression test under tests/evald/ (daemon/test_hardening.py,
daemon/test_server_memory.py, daemon/test_data_path_memory.py, daemon/test_shared_pools.py,
daemon/test_instance_memory.py, daemon/test_compile_sandbox.py, daemon/test_state_load.py,
contract/test_alphabet.py, host/test_epoch_ticker.py), or for the engine adapter under
tests/engine_adapter/ (test_tenant_runtimes.py); the report carries the list so a reader of a
run knows which attacks once worked.
"""

from __future__ import annotations

__all__ = ["HARDENING"]

#: One sentence per finding: what the daemon did, and what it does now.
HARDENING = (
    "A corrupt protobuf request got gRPC's untyped UNKNOWN (unary) or `internal` (stream); "
    "now `invalid_argument` with a message (lenient deserializers in the service).",
    "Tables were uncapped: one `table.fill`/`table.grow` (a single instruction, so neither fuel "
    "nor the epoch stops it) committed ~400 MB and ran 1 s past a 20 ms deadline; stores now "
    "hold at most 4 tables of 65,536 elements.",
    "A compile bomb (a 1.2 MB module of 60,000 tiny functions) took about a minute of CPU at "
    "registration, which cannot be interrupted; the validator caps modules at 10,000 functions "
    "and 1 MiB of code before compiling.",
    "Large messages without a token were read and parsed before authentication (4 clients took "
    "the daemon from 82 MiB to 3.3 GiB); calls are now refused from their metadata, unread.",
    "Streams were bounded in unread results, not bytes (541 MiB held by three non-reading "
    "streams); now in bytes per stream and per tenant, and a stalled stream is cut off.",
    "A batch whose values exceeded the send limit failed whole with a bare RESOURCE_EXHAUSTED; "
    "now every item gets its value or its own output_too_large.",
    "The daemon accepted result regexes that can produce '<' (a role injection through forced "
    "special tokens); the ABI's rule is now enforced at every load.",
    "The epoch ticker waited for the GIL (deadlines overran by up to 1.44 s); it is now a "
    "native thread.",
    "The data path bounded unread output in results (max_batch_items per connection: three "
    "non-reading connections took the daemon from 81 to 192 MiB within a second and growing), "
    "sent a burst as one frame of any size and did not count connections in max_calls; it now "
    "shares the streams' byte budgets and stall cut-off, splits frames, and counts them.",
    "1,024 health Watch streams without a token filled gRPC's call cap, and every tenant got an "
    "untyped RESOURCE_EXHAUSTED; Watch calls with 4 MB service names held ~16 MiB each. Every "
    "call now passes one gate: services that need no token have their own open_calls (streams "
    "at most half) and read requests of at most open_request_bytes; refusals are typed.",
    "One tenant's 128 idle data-path connections (within its max_calls) locked every other "
    "tenant out, and so did silent connections that never sent a HELLO; gRPC calls and "
    "data-path connections are now shared in per-tenant shares, connections before their HELLO "
    "have a small pool of their own (a silent one past its grace makes room), and idle streams "
    "and connections are closed.",
    "64 data-path connections that sent the header of an 8 MiB frame and all but one byte held "
    "+526 MiB for ever; a frame (and a unary call's request) must now arrive within "
    "frame_timeout_s, and its bytes count in the sender's request_bytes before they are read.",
    "Deleting a module evicted only the deleting thread's instances and each worker kept up to "
    "64 (16 register-fill-delete cycles of 48 MiB left the idle daemon at 848 MiB); every "
    "worker's instances of a deleted or replaced module now go, and a tenant's kept instances "
    "hold at most instance_cache_bytes.",
    "The compile worker had no memory bound: one 437 KB function of 20,000 branches over 2,000 "
    "locals drove it to 1.85 GiB; functions are now capped in branches and locals times "
    "branches before compiling, and the worker compiles on one thread under RLIMIT_DATA.",
    "On SIGTERM a compilation ran on past the grace period (exit after 19.8 s with 10 s) and "
    "queued registrations got an untyped CANCELLED; waiting ones now get unavailable at once, "
    "the compiling one at the grace period. After kill -9 of the daemon its compile worker and "
    "multiprocessing's resource tracker lived on; the worker now watches a pipe and exits.",
    "Eight slow registrations of one tenant kept another's out of the compile queue for 45 s; "
    "each tenant now holds at most compile_queue_per_tenant of it, served round-robin.",
    "Adding \"calc\" to a tenant's index file and restarting made that tenant's calc run its own "
    "module; index entries are now held to the registration rules at load.",
    "Every pod's evald_daemon login could set evald.head to 0 or 2^63-1, point any tenant's "
    "evaluator at another's module and write audit rows in an operator's name; it now writes "
    "only through the store's SECURITY DEFINER functions (the head moves forward by one, rules "
    "checked in the store, audit rows stamped with session_user), and a daemon that finds the "
    "head below its revision raises an alarm instead of rewinding.",
    "A tenant row whose limits were nested 3,000 deep raised RecursionError in every daemon's "
    "follower, which took it for its own shutdown: changes stopped while store health said "
    "SERVING; rows are now decoded one at a time (a bad row costs its tenant), the follower "
    "stops only when told, and a stopped follower turns store health NOT_SERVING.",
    "Any login of the cluster could connect to the store's database and flood NOTIFY "
    "evald_changes (3,000 notifications cost a daemon 617 store reads); evald store init now "
    "revokes PUBLIC's CONNECT and TEMP, and a daemon reads once per burst (14 reads).",
    "A daemon cut off from the store served a revoked token for as long as the outage lasted, "
    "and one restarted from its cache accepted a token revoked meanwhile; store tenants are "
    "now refused unavailable past [store] max_stale_s (300 s) without a confirmed read, and "
    "evald_store_revision_age_seconds exports the age.",
    "evald tenants add X --token-sha256 <a config tenant's hash> made that tenant's calls run "
    "as X, silently; the CLI refuses it, and a daemon refuses such a store tenant (logged, "
    "naming both) and keeps the token the config's.",
    "One control thread compiled modules and applied changes: a revocation committed while "
    "another tenant's module compiled applied after the compile (5.6 s on every daemon, SIGHUP "
    "6.4 s) and a new daemon compiled its whole store before it served; compiles and loads now "
    "run on a module thread, tenants and tokens apply at once, and a module still loading "
    "answers unavailable (retry).",
    "A registration sent with a token revoked while it compiled still committed and replaced "
    "the tenant's evaluator; at commit the call's token must still name its tenant (the fleet "
    "daemon first catches up with the store), else permission_denied and nothing changes.",
    "Metric series of deleted evaluators stayed for the daemon's life (35 series, 2.7 KiB per "
    "name ever registered); a deleted evaluator's and a removed tenant's series are removed.",
    "A manifest holding \\u0000 was answered unavailable ... retry (PostgreSQL cannot store it) "
    "and one with a lone surrogate broke listing (internal); text no store can keep is now "
    "invalid_module, naming the field.",
    "In the engine adapter one tenant's 300 valid tokens pushed every other tenant out of the "
    "256 slots (least recently used first); past the cap the adapter now evicts the least "
    "recently used token of the party holding the most slots (a party: the evald address and "
    "the evaluators its tokens grant), so a tenant with many tokens evicts only its own.",
    "In the engine adapter one thread checked every new token, newest first, up to 5 s each, so "
    "2 requests a second naming an allowed address that accepts and never answers left a real "
    "new tenant's first span without a value after 60 s; checks now run per address, a check "
    "gets 2 s to connect, and an address that did not answer is answered unavailable for 2 s "
    "(measured on a loaded 2-core machine: the new tenant's span had its value in 0.01-0.8 s).",
)
