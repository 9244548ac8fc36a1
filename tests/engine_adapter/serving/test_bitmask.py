"""The bitmask layout both plugins read and narrow: XGrammar's 32-bit words, bit 31 the sign."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar

from engine_adapter.serving._bitmask import allow_only, allows

VOCAB = 100


@pytest.mark.parametrize("token", [0, 1, 31, 32, 63, 64, 99])
def test_narrowing_a_row_allows_that_token_alone_as_xgrammar_reads_it(token: int) -> None:
    mask = xgrammar.allocate_token_bitmask(1, VOCAB)  # all allowed
    assert all(allows(mask[0], t) for t in range(VOCAB))
    allow_only(mask[0], token)
    assert [t for t in range(VOCAB) if allows(mask[0], t)] == [token]
    logits = torch.zeros(1, VOCAB)
    xgrammar.apply_token_bitmask_inplace(logits, mask)
    assert [t for t in range(VOCAB) if logits[0, t] != float("-inf")] == [token]


def test_a_token_past_the_row_is_not_allowed() -> None:
    row = np.full(4, -1, dtype=np.int32)  # 128 tokens, all allowed
    assert allows(row, 127) and not allows(row, 128) and not allows(row, -1)
