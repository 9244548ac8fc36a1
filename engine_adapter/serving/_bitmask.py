"""Reading and narrowing one row of a grammar's token bitmask (XGrammar's layout, which both
SGLang and vLLM use): token ``t`` is allowed when bit ``t % 32`` of 32-bit word ``t // 32`` is
set. One home for the layout, so the two plugins cannot read it differently.
"""

from __future__ import annotations

from typing import Any

__all__ = ["allow_only", "allows"]

_WORD_BITS = 32


def allows(row: Any, token: int) -> bool:
    """Whether the bitmask row (a 1-D sequence of int32 words: a tensor or array row) allows
    ``token``; a token past the row's end is not allowed."""
    word, bit = divmod(token, _WORD_BITS)
    return 0 <= word < len(row) and bool((int(row[word]) >> bit) & 1)


def allow_only(row: Any, token: int) -> None:
    """Narrows the bitmask row in place to ``token`` alone (bit 31 is the int32 sign bit)."""
    word, bit = divmod(token, _WORD_BITS)
    row[:] = 0
    row[word] = (1 << bit) if bit < _WORD_BITS - 1 else -(1 << (_WORD_BITS - 1))
