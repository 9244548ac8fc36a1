"""Streaming an answer's text as its token ids arrive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Detokenizer"]

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character.

    Decoding the whole answer each step is simple and exact (merged BPE tokens such as ``><``
    decode correctly only in context); for answers of a few hundred tokens it costs well under a
    millisecond per step.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def text(self) -> str:
        """The whole answer so far, decoded in one piece."""
        decoded: str = self._tokenizer.decode(self.ids, skip_special_tokens=False)
        return decoded

    def push(self, ids: Sequence[int]) -> str:
        """Adds ids; returns the newly complete text (empty while a character is incomplete)."""
        self.ids.extend(ids)
        text = self.text()
        if text.endswith(_REPLACEMENT) or not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def finish(self) -> tuple[str, str]:
        """The final text, and what of it was never emitted (a character left incomplete, or a
        decoding that changed earlier text: then nothing more can be streamed)."""
        text = self.text()
        tail = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        return text, tail
