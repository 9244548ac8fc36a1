"""SmolLM2 on llama.cpp (llama-cpp-python): the fast local backend.

It reads the Q4_1 GGUF as is (loads in under a second, about 200 MiB) and decodes a token in
about 15 ms on two cores — close to one GPU decode step, which keeps the overhead ratios of the
benchmarks honest. Only the low-level pieces of ``llama_cpp.Llama`` are used: ``eval`` to extend
the KV cache, the context's ``get_logits_ith(-1)`` for the last position (``Llama.scores`` stays
empty unless every position's logits are kept), and ``n_tokens`` plus ``kv_cache_seq_rm`` to
roll back. Tokenization and the chat template come from the transformers tokenizer, which
tokenizes SmolLM2's text exactly as llama.cpp does.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
import torch

from engine_adapter._backend import Backend, BackendError
from engine_adapter._model_files import smollm2_gguf_path

__all__ = ["LlamaBackend"]


class LlamaBackend(Backend):
    """llama.cpp with one sequence; rollback drops KV-cache cells past the new length."""

    name = "llama"

    def __init__(self, *, n_ctx: int = 4096, n_threads: int | None = None) -> None:
        super().__init__()
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise BackendError(
                "the llama backend needs llama-cpp-python: pip install -e '.[llama]' "
                "(builds llama.cpp once), or use --backend hf"
            ) from exc
        try:
            path = smollm2_gguf_path()
        except FileNotFoundError as exc:
            raise BackendError(str(exc)) from exc
        # llama.cpp's own default (half the logical CPUs): its worker threads spin between
        # operations, so on a small shared machine more threads make every step slower.
        threads = n_threads or max(1, (os.cpu_count() or 2) // 2)
        self._llm: Any = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self._n_ctx = int(self._llm.n_ctx())
        self._vocab_size = int(self._llm.n_vocab())
        self._eos = int(self._llm.token_eos())

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
        llm = self._llm
        if llm.n_tokens != self.n_tokens:  # pragma: no cover - guards the invariant
            raise BackendError("llama.cpp's cache length drifted from the backend's")
        llm.eval(token_ids)
        pointer = llm._ctx.get_logits_ith(-1)
        if not pointer:
            raise BackendError("llama.cpp returned no logits for the last position")
        row = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self._vocab_size,)
        )
        # Copy: the buffer belongs to llama.cpp and is overwritten by the next decode.
        return torch.from_numpy(row.copy())

    def _truncate(self, n_tokens: int) -> None:
        llm = self._llm
        llm._ctx.kv_cache_seq_rm(-1, n_tokens, -1)
        llm.n_tokens = n_tokens

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None
