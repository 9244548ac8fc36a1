"""Choosing the next token from masked logits: greedy, or seeded nucleus sampling."""

from __future__ import annotations

import torch

__all__ = ["Sampler"]


class Sampler:
    """Greedy (``temperature == 0``) or seeded nucleus sampling; one per request, so that the
    same seed, prompt and backend give the same answer.

    Parameters:
        temperature: ``0`` for greedy decoding, else the softmax temperature.
        top_p: nucleus mass kept (``1.0``: the whole distribution).
        seed: seeds this request's generator (``None``: torch's default seed).
    """

    def __init__(self, temperature: float, top_p: float, seed: int | None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)

    def next_token(self, logits: torch.Tensor) -> int | None:
        """The chosen token id; ``None`` when every token is masked."""
        if self.temperature == 0:
            token = int(torch.argmax(logits))
            return None if logits[token] == float("-inf") else token
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if not torch.isfinite(probs).all() or float(probs.sum()) <= 0:
            return None
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < self.top_p
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = int(torch.multinomial(sorted_probs, 1, generator=self._generator))
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self._generator))
