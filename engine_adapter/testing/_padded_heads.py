"""SmolLM2 with its attention heads zero-padded, so that tensor-parallel ranks can split them.

vLLM shards attention by heads and refuses a model whose head counts its ranks cannot split:
SmolLM2-135M has 9 query heads over 3 key/value heads, and ``--tensor-parallel-size 2`` stops
at start-up with "Total number of attention heads (9) must be divisible by tensor parallel size
(2)". SGLang's CPU build pads such a model's heads itself at load
(``sglang.srt.configs.update_config.adjust_config_with_unaligned_cpu_tp``); vLLM does not, so
the tests pad the weights once, the same way, into a folder of their own.

The padding changes nothing the model computes. Each query head ``i`` reads key/value head
``i // group``; whole groups are appended (a zero key/value head and ``group`` zero query
heads), so every original head keeps its own key/value head, and the output projection's
columns for the new heads are zero, so they add exactly nothing to the residual stream. A model
served on several ranks with real head counts that divide (a 70B model's 64 query and 8
key/value heads on 2, 4 or 8 ranks) needs none of this.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["padded_head_counts", "padded_weights", "tensor_parallel_model_folder"]

#: The projections whose output rows are heads (query; key and value), and the one whose input
#: columns are query heads (output).
_QUERY, _KEY_VALUE, _OUTPUT = ("q_proj",), ("k_proj", "v_proj"), "o_proj"


def _splits(heads: int, kv_heads: int, ranks: int) -> bool:
    """Whether vLLM's ranks can split these counts: query heads evenly, key/value heads evenly
    or each replicated on a whole number of ranks (``QKVParallelLinear``)."""
    kv_fits = kv_heads % ranks == 0 if kv_heads >= ranks else ranks % kv_heads == 0
    return heads % ranks == 0 and kv_fits


def padded_head_counts(heads: int, kv_heads: int, ranks: int) -> tuple[int, int]:
    """The fewest ``(query heads, key/value heads)`` at or above the model's that ``ranks``
    can split, keeping the query heads per key/value head (9 and 3 on 2 ranks: 12 and 4);
    the model's own counts where they split already.

    Raises:
        ValueError: ``ranks`` below 1, or query heads that are not a whole number of groups.
    """
    if ranks < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"cannot pad {heads} query heads over {kv_heads} key/value heads for {ranks} ranks"
        )
    if _splits(heads, kv_heads, ranks):
        return heads, kv_heads
    group = heads // kv_heads
    padded_kv = -(-kv_heads // ranks) * ranks
    return padded_kv * group, padded_kv


def padded_weights(
    weights: dict[str, Any], head_dim: int, kv_heads: int, padded_kv_heads: int
) -> dict[str, Any]:
    """``weights`` (a Llama state dict of torch tensors) with the attention projections grown
    from ``kv_heads`` to ``padded_kv_heads`` key/value heads, each new one with its group of
    query heads, all of it zeros appended after the model's own heads."""
    import torch

    grow = padded_kv_heads - kv_heads
    padded: dict[str, Any] = {}
    for name, tensor in weights.items():
        projection = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if projection in (*_QUERY, *_KEY_VALUE):
            group = 1 if projection in _KEY_VALUE else tensor.shape[0] // (kv_heads * head_dim)
            rows = torch.zeros(grow * group * head_dim, tensor.shape[1], dtype=tensor.dtype)
            tensor = torch.cat([tensor, rows], dim=0)
        elif projection == _OUTPUT:
            group = tensor.shape[1] // (kv_heads * head_dim)
            columns = torch.zeros(tensor.shape[0], grow * group * head_dim, dtype=tensor.dtype)
            tensor = torch.cat([tensor, columns], dim=1)
        padded[name] = tensor.contiguous()
    return padded


def tensor_parallel_model_folder(source: Path, ranks: int) -> Path:
    """``source`` (a transformers Llama folder: ``config.json``, ``model.safetensors``, the
    tokenizer) as a folder that ``ranks`` tensor-parallel ranks can split, made once next to it
    (``SOURCE-tpN``); ``source`` itself where its head counts split already.

    Concurrent first calls each write a private staging folder and the first rename wins, so a
    half-written folder is never visible.
    """
    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    padded_heads, padded_kv = padded_head_counts(heads, kv_heads, ranks)
    if (padded_heads, padded_kv) == (heads, kv_heads):
        return source
    target = source.with_name(f"{source.name}-tp{ranks}")
    if (target / "model.safetensors").exists():
        return target
    from safetensors.torch import load_file, save_file

    staging = target.with_name(target.name + f".{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        weights = padded_weights(
            load_file(source / "model.safetensors"), head_dim, kv_heads, padded_kv
        )
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
        config.update(
            num_attention_heads=padded_heads, num_key_value_heads=padded_kv, head_dim=head_dim
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for item in source.iterdir():
            if item.name not in ("config.json", "model.safetensors"):
                (staging / item.name).symlink_to(item.resolve())
        staging.rename(target)
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
