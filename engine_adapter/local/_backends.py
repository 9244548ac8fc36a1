"""Choosing a model runtime by name: the one place that knows every :class:`Backend`.

The interface (``_backend.py``) knows no runtime, and each runtime imports only the interface,
so adding a runtime is one module plus one branch here.
"""

from __future__ import annotations

from engine_adapter.local._backend import Backend, BackendError

__all__ = ["BACKEND_NAMES", "load_backend"]

#: The names accepted by :func:`load_backend` and ``engine-adapter --backend``.
BACKEND_NAMES = ("llama", "hf")


def load_backend(
    name: str, *, n_ctx: int = 4096, n_threads: int | None = None, model: str = "smollm2"
) -> Backend:
    """Loads a model (SmolLM2-135M-Instruct unless ``model`` names another) with the named
    runtime.

    Parameters:
        name: ``"llama"`` (llama-cpp-python, the fast default) or ``"hf"`` (transformers on
            CPU torch: nothing to compile, about six times slower per token).
        n_ctx: context window in positions.
        n_threads: CPU threads for the runtime; ``None`` lets it choose.
        model: ``smollm2`` or ``gemma3-270m`` (llama backend only).

    Raises:
        BackendError: unknown name, or the runtime or the model file is not installed (the
            message says which package to install).
    """
    if name == "llama":
        from engine_adapter.local._llama_backend import LlamaBackend

        return LlamaBackend(n_ctx=n_ctx, n_threads=n_threads, model=model)
    if model != "smollm2":
        raise BackendError(f"the {name} backend runs only smollm2; use --backend llama")
    if name == "hf":
        from engine_adapter.local._hf_backend import HFBackend

        return HFBackend(n_ctx=n_ctx, n_threads=n_threads)
    raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
