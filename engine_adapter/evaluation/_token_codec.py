"""The tokenizer's bytes for span detection and result forcing: one codec per engine.

The :class:`~engine_adapter.evaluation.Injector` reads a sequence as bytes (a tag may begin or
end inside a token) and forces a result as the tokens that spell exactly its remaining bytes;
both need every token's bytes and an encoding that never strays into special tokens. Building
that table from a 49k vocabulary takes about a second, so it lives apart from the per-request
state and is shared by all of an engine's requests.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["TokenCodec"]


class TokenCodec:
    """The bytes of every token, and the encoding of a continuation, for one tokenizer.

    Engine-wide and immutable after construction: share one among all requests (building it
    from a 49k vocabulary takes about a second).

    Parameters:
        token_bytes: the exact bytes each token id decodes to (``TokenizerInfo.decoded_vocab``);
            ids beyond the list decode to nothing (padding rows of a larger LM head).
        encode: the tokenizer's own encoding (no special tokens added). Its output is used only
            when the tokens decode back to exactly the text asked for; otherwise (a tokenizer
            that prepends a space to every encoding, or a text that starts inside a UTF-8
            character) a greedy longest-match over the vocabulary is used.
        special_ids: ids never used to force text (chat markers that happen to spell text).
        special_texts: the text of the tokenizer's special tokens (``<|im_end|>``). A value
            that contains one is never forced: re-tokenized, it would become the special
            token itself (a role change with the grammar's authority). The text of every
            special id that decodes to some is added.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        encode: Callable[[str], Sequence[int]] | None = None,
        *,
        special_ids: Iterable[int] = (),
        special_texts: Iterable[str] = (),
    ) -> None:
        self._bytes = [bytes(raw) for raw in token_bytes]  # plain bytes, not FFI wrappers
        self._encode = encode
        self._special = frozenset(special_ids)
        texts = set(special_texts)
        for token_id in self._special:
            if 0 <= token_id < len(self._bytes):
                with contextlib.suppress(UnicodeDecodeError):
                    texts.add(self._bytes[token_id].decode("utf-8"))
        # A special token that spells one character or only white space (a padding id that
        # decodes to " ") cannot be told from ordinary text: it is left to the id check.
        texts = {text for text in texts if len(text) > 1 and not text.isspace()}
        self.special_texts: tuple[str, ...] = tuple(sorted(texts))
        self._greedy: dict[bytes, int] | None = None
        self._greedy_lock = threading.Lock()
        self._max_len = 1

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, *, vocab_size: int | None = None, tokenizer_info: Any = None
    ) -> TokenCodec:
        """From a transformers tokenizer (and its ``xgrammar.TokenizerInfo`` if already built).

        ``vocab_size`` is the model's LM-head size when it differs from the tokenizer's.
        """
        if tokenizer_info is None:
            import xgrammar

            tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size
            )
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special = {int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
        texts = {
            str(getattr(tok, "content", ""))
            for tok in decoder.values()
            if getattr(tok, "special", False)
        }
        special.update(tokenizer_info.special_token_ids)
        special.update(tokenizer_info.stop_token_ids)

        def encode(text: str) -> Sequence[int]:
            ids: Sequence[int] = tokenizer.encode(text, add_special_tokens=False)
            return ids

        return cls(tokenizer_info.decoded_vocab, encode, special_ids=special, special_texts=texts)

    @classmethod
    def shared(cls, tokenizer: Any) -> TokenCodec:
        """One codec per tokenizer object in this process (built on first use)."""
        with _SHARED_LOCK:
            entry = _SHARED.get(id(tokenizer))
            if entry is not None and entry[0] is tokenizer:
                return entry[1]
        codec = cls.from_tokenizer(tokenizer)
        with _SHARED_LOCK:
            _SHARED[id(tokenizer)] = (tokenizer, codec)
        return codec

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def byte_table(self) -> Sequence[bytes]:
        """Every token's bytes, indexed by id (read-only by contract: the injector's hot path
        indexes it directly)."""
        return self._bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (empty for ids outside the vocabulary)."""
        if 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return b""

    def decode(self, token_ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(t) for t in token_ids)

    def encode_continuation(self, data: bytes) -> list[int]:
        """Tokens whose bytes are exactly ``data``, to be appended after what came before.

        The tokenizer's own encoding is preferred (it is what the model saw in training); the
        result always decodes to ``data`` byte for byte, so the grammar matcher accepts it
        wherever it accepts the text.
        """
        if not data:
            return []
        if self._encode is not None:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None:
                ids = list(self._encode(text))
                if self.decode(ids) == data and not self._special.intersection(ids):
                    return ids
        return self._greedy_encode(data)

    def _greedy_encode(self, data: bytes) -> list[int]:
        table = self._greedy_table()
        out: list[int] = []
        i = 0
        while i < len(data):
            for size in range(min(self._max_len, len(data) - i), 0, -1):
                tid = table.get(data[i : i + size])
                if tid is not None:
                    out.append(tid)
                    i += size
                    break
            else:
                raise ValueError(f"no token spells byte {data[i : i + 1]!r}: cannot force it")
        return out

    def _greedy_table(self) -> dict[bytes, int]:
        with self._greedy_lock:
            if self._greedy is None:
                table: dict[bytes, int] = {}
                for tid, raw in enumerate(self._bytes):
                    if raw and tid not in self._special:
                        table.setdefault(raw, tid)
                self._max_len = max((len(raw) for raw in table), default=1)
                self._greedy = table
            return self._greedy


_SHARED: dict[int, tuple[Any, TokenCodec]] = {}
_SHARED_LOCK = threading.Lock()
