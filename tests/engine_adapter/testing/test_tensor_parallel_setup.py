"""What a tensor-parallel test server is started with: SmolLM2 with its attention heads padded
so that the ranks can split them (the same model: the same logits), and the engine's CPUs split
between the ranks' OpenMP threads."""

from __future__ import annotations

from typing import Any

import pytest

from engine_adapter.testing import (
    CpuPartition,
    model_folder,
    rank_cpu_lists,
    tensor_parallel_model_folder,
)
from engine_adapter.testing._padded_heads import padded_head_counts


@pytest.mark.parametrize(
    ("heads", "kv_heads", "ranks", "padded"),
    [
        (9, 3, 2, (12, 4)),  # SmolLM2-135M: vLLM refuses 9 heads on 2 ranks
        (9, 3, 1, (9, 3)),
        (9, 3, 3, (9, 3)),
        (9, 3, 4, (12, 4)),
        (64, 8, 8, (64, 8)),  # a 70B Llama splits as it is
        (32, 2, 4, (32, 2)),  # fewer key/value heads than ranks: each is replicated
        (12, 4, 8, (24, 8)),  # 12 query heads do not split 8 ways
        (15, 5, 2, (18, 6)),
    ],
)
def test_head_counts_grow_by_whole_groups_until_the_ranks_split_them(
    heads: int, kv_heads: int, ranks: int, padded: tuple[int, int]
) -> None:
    assert padded_head_counts(heads, kv_heads, ranks) == padded
    grown_heads, grown_kv = padded
    assert grown_heads % ranks == 0
    assert grown_heads // grown_kv == heads // kv_heads  # query heads per key/value head kept


def test_counts_that_cannot_be_padded_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot pad 10 query heads over 3"):
        padded_head_counts(10, 3, 2)
    with pytest.raises(ValueError, match="for 0 ranks"):
        padded_head_counts(9, 3, 0)


def test_each_rank_gets_its_own_cpus() -> None:
    assert rank_cpu_lists(2, "0,1") == "0|1"
    assert rank_cpu_lists(2, "0-2") == "0,1|2"
    assert rank_cpu_lists(4, "0-7") == "0,1|2,3|4,5|6,7"
    assert rank_cpu_lists(1, "0-3") == "0,1,2,3"
    with pytest.raises(ValueError, match="between 3 ranks"):
        rank_cpu_lists(3, "0,1")
    partition = CpuPartition("0-13", "14-15")
    env = partition.engine_env("VLLM_CPU_OMP_THREADS_BIND", 2)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6|7,8,9,10,11,12,13"}
    assert partition.engine_env("X") == {"X": "0-13", "OMP_NUM_THREADS": "14"}


@pytest.mark.model
def test_the_padded_model_computes_what_the_model_does() -> None:
    """The folder a TP = 2 server loads: 12 query and 4 key/value heads (vLLM splits them),
    and for a prompt the same logits as SmolLM2's 9 and 3, so the tests run the same model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_folder()
    folder = tensor_parallel_model_folder(source, 2)
    assert tensor_parallel_model_folder(source, 1) == source
    config = AutoConfig.from_pretrained(folder)
    assert (config.num_attention_heads, config.num_key_value_heads) == (12, 4)
    torch.set_num_threads(1)  # the test machine's cores are shared

    def logits(path: Any) -> Any:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 17, 1047, 216, 33, 42, 1335]])
        with torch.no_grad():
            return model(ids).logits[0]

    original, padded = logits(source), logits(folder)
    assert original.shape == padded.shape
    torch.testing.assert_close(padded, original, rtol=1e-4, atol=1e-4)
    assert torch.equal(padded.argmax(-1), original.argmax(-1))
