"""The narrow interface between the local decode loop and a model runtime.

The decode loop needs only four things from a model: run these token ids through it (extending
its KV cache) and hand back the next-token logits, forget the last positions (rollback), say how
many positions it holds, and name its vocabulary size and end-of-sequence token. Everything
else (chat template, grammar, sampling, injection) lives in the engine, so a new runtime is one
small class and the engine's behaviour does not depend on which runtime runs it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "BackendError"]


class BackendError(RuntimeError):
    """A backend could not be loaded or was used outside its contract (for example, forwarding
    past its context window or truncating to a length it does not hold)."""


class Backend(abc.ABC):
    """One sequence's model state: the weights plus a KV cache over :attr:`n_tokens` positions.

    Not thread-safe: one decode loop owns a backend at a time. The token ids the cache holds are
    kept in :attr:`tokens`, so the engine can reuse a shared prompt prefix across requests.
    """

    #: Short runtime name, as used by ``--backend`` ("llama" or "hf").
    name: str = ""

    def __init__(self) -> None:
        self._tokens: list[int] = []

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Width of the logits row (the model's vocabulary; may exceed the tokenizer's)."""

    @property
    @abc.abstractmethod
    def eos_token_id(self) -> int:
        """The token that ends an assistant turn (``<|im_end|>`` for SmolLM2-Instruct)."""

    @property
    @abc.abstractmethod
    def n_ctx(self) -> int:
        """The most positions the KV cache can hold."""

    @property
    def n_tokens(self) -> int:
        """Positions currently in the KV cache."""
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token ids in the KV cache, oldest first."""
        return tuple(self._tokens)

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Appends ``token_ids`` to the KV cache in one forward pass.

        Parameters:
            token_ids: at least one id, each in ``[0, vocab_size)``.

        Returns:
            The logits that follow the last id: a new float32 CPU tensor of shape
            ``(vocab_size,)`` that the caller owns (it may mask it in place).

        Raises:
            BackendError: empty input, an id out of range, or the context window would overflow.
                The cache is unchanged when this is raised.
        """
        ids = [int(token) for token in token_ids]
        if not ids:
            raise BackendError("forward needs at least one token id")
        bad = [token for token in ids if not 0 <= token < self.vocab_size]
        if bad:
            raise BackendError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if self.n_tokens + len(ids) > self.n_ctx:
            raise BackendError(
                f"context window of {self.n_ctx} positions exceeded "
                f"({self.n_tokens} held + {len(ids)} new); lower --max-new-tokens"
            )
        logits = self._forward(ids)
        self._tokens.extend(ids)
        return logits

    def truncate(self, n_tokens: int) -> None:
        """Keeps only the first ``n_tokens`` positions; the next :meth:`forward` continues
        from there exactly as if the dropped positions had never been fed.

        Raises:
            BackendError: ``n_tokens`` is negative or larger than :attr:`n_tokens`.
        """
        if not 0 <= n_tokens <= self.n_tokens:
            raise BackendError(f"cannot truncate to {n_tokens} positions; {self.n_tokens} held")
        if n_tokens == self.n_tokens:
            return
        self._truncate(n_tokens)
        del self._tokens[n_tokens:]

    def rollback(self, k: int) -> None:
        """Drops the last ``k`` positions (``truncate(n_tokens - k)``)."""
        if k < 0:
            raise BackendError(f"cannot roll back a negative number of positions ({k})")
        self.truncate(self.n_tokens - k)

    def reset(self) -> None:
        """Empties the KV cache."""
        self.truncate(0)

    def close(self) -> None:  # noqa: B027 - optional hook: most runtimes free on GC
        """Releases native resources early; the backend must not be used afterwards."""

    @abc.abstractmethod
    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        """Runs validated ids at positions ``n_tokens …``; returns the last position's logits."""

    @abc.abstractmethod
    def _truncate(self, n_tokens: int) -> None:
        """Drops cache positions ``n_tokens …`` (validated, strictly fewer than held)."""
