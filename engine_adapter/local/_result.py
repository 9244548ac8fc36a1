"""What :meth:`~engine_adapter.local.LocalEngine.generate` gives back: the answer with its spans
and per-step timings, and the callback type that streams the answer as it is produced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GenerationResult", "SpanTiming", "StepTiming", "TextCallback"]

#: Called with each new piece of text as it is produced; ``forced`` is true for text the engine
#: forced (the prefix and injected results) rather than text the model sampled.
TextCallback = Callable[[str, bool], None]


@dataclass(frozen=True)
class StepTiming:
    """One decode step. ``kind`` is ``prefill`` (prompt and prefix), ``sample`` (one sampled
    token forwarded) or ``inject`` (a sampled token plus forced result tokens in one forward)."""

    kind: str
    n_forwarded: int
    forward_us: int
    mask_us: int = 0
    sample_us: int = 0
    accept_us: int = 0
    wait_us: int = 0
    """Time spent blocked on an evaluation result (0 when it was ready)."""


@dataclass(frozen=True)
class SpanTiming:
    """One evaluated span, as the engine saw it."""

    evaluator: str
    content: str
    forced_text: str
    """The text the engine forced after the span (``<result>482</result>`` or an error)."""
    value: str | None
    error_code: str | None
    n_forced_tokens: int
    wait_us: int
    """Blocked on the evaluation after the span closed (0 if the result was already there)."""
    eval_latency_us: int
    """From submission to the result being available, as measured by the injector."""
    inject_forward_us: int
    """The one forward that carried the sampled token plus the forced tokens."""
    step: int
    """Sampled tokens so far when the span closed."""
    forced_at: int = -1
    """Index in :attr:`GenerationResult.token_ids` of the first forced token (-1: none)."""
    field: str | None = None
    """For a computed property of a JSON answer: its JSON pointer (``content`` is the input
    built from the values it is computed from; ``forced_text`` the value or error object)."""


@dataclass
class GenerationResult:
    """What :meth:`LocalEngine.generate` returns.

    ``text`` is the answer as the model's context holds it: the forced prefix, sampled text and
    injected results, without the end-of-turn token.
    """

    text: str
    mode: str
    backend: str
    prompt_tokens: int
    reused_cache_tokens: int
    token_ids: list[int]
    n_sampled: int
    n_forced: int
    stop_reason: str
    """``eos`` (the model ended its turn, or the grammar ended the answer), ``max_new_tokens``,
    ``stop`` (a stop string appeared), ``context`` (window full) or ``grammar`` (the grammar
    allowed no token, which a correct grammar never does)."""
    spans: list[SpanTiming] = field(default_factory=list)
    steps: list[StepTiming] = field(default_factory=list)
    prefill_us: int = 0
    decode_us: int = 0
    total_us: int = 0
    grammar_compile_us: int = 0
    operands: dict[str, Any] | None = None
    """What the operands option did (:meth:`engine_adapter.OperandNarrowing.to_dict`): the
    literals each evaluator's rules were narrowed to, or why not; ``None`` when not asked."""

    @property
    def n_forwards(self) -> int:
        """Forward passes after the prefill."""
        return sum(1 for step in self.steps if step.kind != "prefill")

    @property
    def tokens_per_s(self) -> float:
        """Sampled plus forced tokens per second of decoding (prefill excluded)."""
        n = self.n_sampled + self.n_forced
        return n / (self.decode_us / 1e6) if self.decode_us > 0 else 0.0

    def to_dict(self, *, with_steps: bool = False) -> dict[str, Any]:
        """A JSON-ready summary (per-step timings only when asked: they are long)."""
        out = asdict(self)
        if not with_steps:
            out.pop("steps")
        out["n_forwards"] = self.n_forwards
        out["tokens_per_s"] = round(self.tokens_per_s, 2)
        return out
