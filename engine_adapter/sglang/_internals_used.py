"""The SGLang internals the adapter's hooks read or call (``sglang==0.5.23``), one table.

No public SGLang API promises these: attributes set in ``Scheduler.__init__``, fields of
``Req`` and ``ScheduleBatch``, the grammar manager's and backend's methods, the group the
tensor-parallel ranks exchange over. ``plugin.check_internals`` checks every one at start-up
(``engine_adapter.serving.missing_internals``) and stops the process naming what is missing.
"""

from __future__ import annotations

__all__ = ["INTERNALS"]

#: Dotted owner -> the names the adapter uses on it.
INTERNALS = {
    "sglang.srt.managers.schedule_batch.ScheduleBatch": (
        "init_new", "prepare_for_extend", "prepare_for_decode", "filter_batch",
        "mix_with_running", "check_decode_mem", "is_empty", "reqs", "batch_is_full",
        "return_logprob", "decoding_reqs", "contains_last_prefill_chunk",
        "hisparse_coordinator",
    ),
    "sglang.srt.managers.schedule_batch.Req": (
        "seqlen", "finished", "refresh_fill_ids", "extend_len", "output_ids", "grammar",
        "to_finish", "prefix_len", "extend_end", "already_computed", "kv", "sampling_params",
        "rid", "return_logprob", "grammar_key", "set_finish_with_abort",
    ),
    "sglang.srt.managers.schedule_batch.ReqKvInfo": ("kv_committed_len",),
    "sglang.srt.managers.schedule_batch.NextBatchPlan": ("batch_to_run", "running_batch"),
    "sglang.srt.managers.scheduler.Scheduler": (
        "running_batch", "waiting_queue", "req_to_token_pool", "token_to_kv_pool_allocator",
        "tree_cache", "model_config", "enable_overlap", "spec_algorithm", "is_mixed_chunk",
        "result_queue",
    ),
    "sglang.srt.mem_cache.common": ("evict_from_tree_cache",),
    "sglang.srt.constrained.base_grammar_backend.BaseGrammarBackend": (
        "executor", "get_cached_or_future_value", "set_cache",
    ),
    "sglang.srt.layers.dp_attention": ("get_dp_tp_group",),
    "sglang.srt.constrained.grammar_manager.GrammarManager": (
        "grammar_backend", "get_ready_grammar_requests",
    ),
    "sglang.srt.constrained.base_grammar_backend.InvalidGrammarObject": ("error_message",),
}  # fmt: skip
