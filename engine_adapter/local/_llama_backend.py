"""SmolLM2 on llama.cpp (llama-cpp-python): the fast local backend.

It reads the Q4_1 GGUF as is (loads in under a second, about 200 MiB) and decodes a token in
about 6 to 25 ms depending on the CPU — close to one GPU decode step, which keeps the overhead
ratios of the benchmarks honest. It drives llama-cpp-python's thin wrappers of the C API
(``LlamaModel``, ``LlamaContext``, ``LlamaBatch``) rather than ``llama_cpp.Llama``, because
``Llama()`` does not let a caller set the model parameter this backend may need to set:

**No AMX buffer type.** llama.cpp's AMX "extra buffer type", chosen automatically on CPUs with
AMX (Sapphire Rapids and newer), crashes in ``ggml_backend_amx_mul_mat`` on the first forward on
some of them (a known upstream defect). The Makefile builds llama.cpp without AMX kernels, so the
AMX buffer type does not exist in that build and the other extra buffer type, CPU weight
repacking (fast Q4_0/Q4_K kernels on AVX2/AVX-512), stays on. A llama.cpp built with AMX (a wheel
from elsewhere) is detected from its system info and then loads with every extra buffer type off
(``use_extra_bufts = False``): slower for repackable weights, but it cannot crash. Either way the
crash is impossible rather than unlikely (docs/local-engine.md, "CPU choices").

Tokenization and the chat template come from the transformers tokenizer, which tokenizes
SmolLM2's text exactly as llama.cpp does. The native model is released deterministically:
:meth:`LlamaBackend.close`, or at interpreter exit before Python tears down the modules the
release needs.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from engine_adapter.local._backend import Backend, BackendError
from engine_adapter.local._model_files import DEFAULT_MODEL, gguf_path

__all__ = ["LLAMA_BATCH", "LlamaBackend", "amx_compiled", "default_threads", "model_params"]

#: Positions fed to llama.cpp per decode call (and its micro-batch): a whole prompt in one go.
LLAMA_BATCH = 512


def default_threads() -> tuple[int, int]:
    """(decode threads, prompt threads) when the caller names none.

    Decoding one token is memory-bound and llama.cpp's workers spin between operations, so it
    gets half the CPUs (at least one); a prompt or a forced result (many positions in one
    forward) is compute-bound and gets every CPU. Measured in docs/local-engine.md.
    """
    cpus = os.cpu_count() or 2
    return max(1, cpus // 2), cpus


def amx_compiled() -> bool:
    """Whether the installed llama.cpp has AMX kernels (its AMX buffer type exists)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return "AMX_INT8 = 1" in info


def model_params() -> Any:
    """llama.cpp's default model parameters, with extra buffer types off when AMX is built in."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = not amx_compiled()
    return params


class LlamaBackend(Backend):
    """llama.cpp with one sequence; rollback drops KV-cache cells past the new length.

    ``model`` names the GGUF (:data:`~engine_adapter.local._model_files.MODEL_NAMES`): SmolLM2 by
    default, or Gemma 3 270M for the accuracy study."""

    name = "llama"

    def __init__(
        self, *, n_ctx: int = 4096, n_threads: int | None = None, model: str = DEFAULT_MODEL
    ) -> None:
        super().__init__()
        try:
            import llama_cpp
            from llama_cpp import _internals
            from llama_cpp._logger import set_verbose
        except ImportError as exc:
            raise BackendError(
                "the llama backend needs llama-cpp-python: pip install -e '.[llama]' "
                "(builds llama.cpp once), or use --backend hf"
            ) from exc
        try:
            path = gguf_path(model)
        except (FileNotFoundError, ValueError) as exc:
            raise BackendError(str(exc)) from exc
        set_verbose(False)  # llama.cpp's own log: errors only (what Llama(verbose=False) sets)
        decode_threads, prompt_threads = default_threads()
        self.params = model_params()
        stack = ExitStack()
        try:
            llama_model = _internals.LlamaModel(
                path_model=str(path), params=self.params, verbose=False
            )
            stack.callback(llama_model.close)
            context_params = llama_cpp.llama_context_default_params()
            context_params.n_ctx = n_ctx
            context_params.n_batch = LLAMA_BATCH
            context_params.n_ubatch = LLAMA_BATCH
            context_params.n_threads = n_threads or decode_threads
            context_params.n_threads_batch = n_threads or prompt_threads
            # What Llama() sets: flash attention changes the logits' rounding (greedy text on
            # near ties) and measured no faster here.
            context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            context = _internals.LlamaContext(
                model=llama_model, params=context_params, verbose=False
            )
            stack.callback(context.close)
            batch = _internals.LlamaBatch(n_tokens=LLAMA_BATCH, embd=0, n_seq_max=1, verbose=False)
            stack.callback(batch.close)
        except (ValueError, OSError) as exc:
            stack.close()
            raise BackendError(f"llama.cpp could not load {path}: {exc}") from exc
        self._model: Any = llama_model
        self._ctx: Any = context
        self._batch: Any = batch
        self.threads = (int(context_params.n_threads), int(context_params.n_threads_batch))
        self._n_ctx = int(context.n_ctx())
        self._vocab_size = int(llama_model.n_vocab())
        self._eos = int(llama_model.token_eos())
        # Runs on close() or, for a script that never closes, at interpreter exit while the
        # llama_cpp module is still whole (a release from __del__ during teardown fails).
        self._release = weakref.finalize(self, stack.close)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        if not self._release.alive:
            raise BackendError("the llama backend was closed")
        context, batch = self._ctx, self._batch
        n_past = self.n_tokens
        try:
            for start in range(0, len(token_ids), LLAMA_BATCH):
                chunk = token_ids[start : start + LLAMA_BATCH]
                batch.set_batch(batch=chunk, n_past=n_past + start, logits_all=False)
                context.decode(batch)
        except RuntimeError as exc:
            context.kv_cache_seq_rm(-1, n_past, -1)  # the contract: the cache is unchanged
            raise BackendError(f"llama.cpp decode failed: {exc}") from exc
        pointer = context.get_logits_ith(-1)
        if not pointer:
            context.kv_cache_seq_rm(-1, n_past, -1)
            raise BackendError("llama.cpp returned no logits for the last position")
        row = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self._vocab_size,)
        )
        # Copy: the buffer belongs to llama.cpp and is overwritten by the next decode.
        return torch.from_numpy(row.copy())

    def _truncate(self, n_tokens: int) -> None:
        self._ctx.kv_cache_seq_rm(-1, n_tokens, -1)

    def close(self) -> None:
        """Frees the native context and model now (idempotent)."""
        self._release()
