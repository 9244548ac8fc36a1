"""A speculative-decoding proposer that proposes nothing: vLLM's verify step for forced tokens.

vLLM verifies draft tokens in one forward (every draft position gets logits, the rejection
sampler keeps the drafts the target model agrees with, and one more token is sampled after the
last one kept). The adapter puts a result region's forced tokens into a request's drafts and
narrows each draft position's grammar-bitmask row to that draft, so verification keeps them all:
``<result>482</result>`` enters the sequence in one forward instead of one per token
(``docs/vllm.md``, "One forward per result").

vLLM builds that verify step only when speculative decoding is configured. A server that wants
it without a drafter of its own names this class as a custom proposer::

    --speculative-config '{"method": "custom_class",
                           "model": "engine_adapter.vllm.proposer.ForcedOnlyProposer",
                           "num_speculative_tokens": 16}'

It never drafts, so requests without evaluated spans decode one token per step, as without
speculative decoding. ``num_speculative_tokens`` bounds the forced tokens one forward can take
(a longer region takes more forwards).

vLLM (``vllm==0.32.0``, ``vllm/v1/spec_decode/custom_class_proposer.py``) instantiates the class
in each model-runner process with the server's ``VllmConfig`` and calls ``propose`` after every
step; ``load_model`` is called once by the CPU model runner. Importing this module imports
neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FORCED_ONLY", "ForcedOnlyProposer", "speculative_config"]

#: The dotted path vLLM imports the proposer from.
FORCED_ONLY = f"{__name__}.ForcedOnlyProposer"


class ForcedOnlyProposer:
    """Proposes no draft tokens; the evald adapter drafts the result regions it forces."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model to load."""

    def propose(
        self, sampled_token_ids: Sequence[Any], *args: Any, **kwargs: Any
    ) -> list[list[int]]:
        """No drafts for any request of the step."""
        return [[] for _ in sampled_token_ids]


def speculative_config(num_tokens: int = 16) -> dict[str, Any]:
    """The ``--speculative-config`` value (as a dict; pass it JSON-encoded) that gives the
    adapter vLLM's verify step with no drafter: up to ``num_tokens`` forced tokens per forward,
    plus the one sampled after them.

    Raises:
        ValueError: ``num_tokens`` below 1.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be at least 1, got {num_tokens}")
    return {"method": "custom_class", "model": FORCED_ONLY, "num_speculative_tokens": num_tokens}
