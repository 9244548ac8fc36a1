"""Attention-schema shim (this project's code, not upstream), installed as ``sgl_kernel/_evald_compat.py``.

SGLang 0.5.23's intel_amx attention backend calls ``extend_attention_cpu`` and
``decode_attention_cpu`` with the Oct-2026 schema, which added ``key_scale`` /
``value_scale`` (FP8 KV cache) and, for extend, a trailing ``is_causal``. The
CPU kernel (sgl-kernel-cpu-src.tar.gz) is an Aug-2026 snapshot that predates those arguments. These
wrappers take the new argument list and call the old ops, refusing (loudly) the cases
the old ops cannot do: a scaled (FP8) KV cache and non-causal attention.

If the loaded kernel already has the new schema, the native ops are used unchanged.
"""
import torch

_ns = torch.ops.sgl_kernel


def _nargs(op):
    return len(op.default._schema.arguments)


# (extend, decode) argument counts: Aug-2026 kernel (19, 17); the schema 0.5.23 calls (22, 19).
_SCHEMA = (_nargs(_ns.extend_attention_cpu), _nargs(_ns.decode_attention_cpu))
if _SCHEMA not in ((19, 17), (22, 19)):
    raise ImportError(f"evald sgl_kernel shim: unknown sgl_kernel attention schema {_SCHEMA}")

if _SCHEMA == (22, 19):  # a newer kernel: nothing to adapt
    extend_attention_cpu = _ns.extend_attention_cpu
    decode_attention_cpu = _ns.decode_attention_cpu
else:
    _extend = _ns.extend_attention_cpu
    _decode = _ns.decode_attention_cpu

    def extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, key_scale, value_scale,
                             req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
                             extend_start_loc, max_len_extend, sm_scale, logit_cap,
                             is_cross_attn, sliding_window_size, encoder_lens, sinks,
                             tree_mask=None, is_causal=True):
        if key_scale != 1.0 or value_scale != 1.0:
            raise NotImplementedError("evald sgl_kernel shim: this CPU kernel has no scaled (FP8) KV cache")
        if not is_causal:
            raise NotImplementedError("evald sgl_kernel shim: this CPU kernel has no non-causal extend attention")
        return _extend(q, k, v, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                       extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
                       is_cross_attn, sliding_window_size, encoder_lens, sinks, tree_mask)

    def decode_attention_cpu(q, k_buffer, v_buffer, key_scale, value_scale, o, k, v, loc,
                             attn_logits, req_to_token, req_pool_indices, seq_lens, sm_scale,
                             logit_cap, is_cross_attn, sliding_window_size, encoder_lens, sinks):
        if key_scale != 1.0 or value_scale != 1.0:
            raise NotImplementedError("evald sgl_kernel shim: this CPU kernel has no scaled (FP8) KV cache")
        return _decode(q, k_buffer, v_buffer, o, k, v, loc, attn_logits, req_to_token,
                       req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attn,
                       sliding_window_size, encoder_lens, sinks)
