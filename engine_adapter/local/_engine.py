"""The local CPU engine: a decode loop over a real model, with the span grammar and injection.

One step: fill the grammar's token bitmask, mask the logits, sample, feed the token to the
grammar matcher and to the :class:`~engine_adapter.Injector`; when the injector has forced tokens
queued (a span closed and its result is ready), feed them to the matcher too and run the sampled
token **and all forced tokens in one forward**, so the KV cache holds the injected result exactly
as if the model had written it, at the cost of one decode step. SGLang cannot do that yet (each
forced token is a step there); this engine shows the floor.

Only :class:`~engine_adapter.local._backend.Backend` touches the model, so the loop is the same on
llama.cpp and on transformers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from engine_adapter._grammar import (
    EvaluatorSpec,
    Mode,
    SpanGrammar,
    build_structural_tag,
    special_token_texts,
)
from engine_adapter._injector import Injector, TokenCodec
from engine_adapter.local._backend import Backend

if TYPE_CHECKING:
    from engine_adapter._types import SpanEvaluator

__all__ = [
    "EVALUATOR_MODES",
    "EngineError",
    "EvaluatorSetup",
    "GenerationResult",
    "LocalEngine",
    "SpanTiming",
    "StepTiming",
    "TextCallback",
    "open_evaluator",
]

#: Called with each new piece of text as it is produced; ``forced`` is true for text the engine
#: forced (the prefix and injected results) rather than text the model sampled.
TextCallback = Callable[[str, bool], None]

_REPLACEMENT = "\ufffd"

#: Where ``grammar-eval`` spans go: the evald daemon, the WASM host inside this process, or the
#: Python reference implementations.
EVALUATOR_MODES = ("evald", "inprocess", "python")


class EngineError(ValueError):
    """A request the engine cannot run: a prefix the grammar refuses, a prompt longer than the
    context window, a mode that needs an evaluator when none was given."""


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
    """``eos`` (the model ended its turn), ``max_new_tokens``, ``context`` (window full) or
    ``grammar`` (the grammar allowed no token, which a correct grammar never does)."""
    spans: list[SpanTiming] = field(default_factory=list)
    steps: list[StepTiming] = field(default_factory=list)
    prefill_us: int = 0
    decode_us: int = 0
    total_us: int = 0
    grammar_compile_us: int = 0

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


def _us(start_ns: int) -> int:
    return (time.perf_counter_ns() - start_ns) // 1000


class _Detokenizer:
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


class LocalEngine:
    """Generates one answer at a time over a :class:`Backend`, with the span grammar.

    Compiled grammars are cached by their JSON; the KV cache of the previous request is
    reused for the longest shared prompt prefix (the system prompt, in the accuracy study).
    Not thread-safe.

    Parameters:
        backend: the model runtime (see :func:`engine_adapter.load_backend`).
        tokenizer: SmolLM2's transformers tokenizer (:func:`engine_adapter.load_tokenizer`).
        evaluators: the evaluators whose spans the grammar allows (from ``ListEvaluators`` or
            :func:`engine_adapter.standard_evaluators`).
        evaluator: where ``grammar-eval`` sends spans (evald stream client, in-process WASM host
            or Python reference); not needed for the other modes.
        deadline_ms: per-span evaluation deadline; past it the engine forces
            ``<result_error>deadline_exceeded</result_error>`` and goes on.
        system_prompt: the chat system message (``None``: the template's default). For a base
            model (a tokenizer without a chat template) it is the text before the question,
            such as ``render_instructions(evaluators, style="few-shot")``, and the question is
            asked in :data:`~engine_adapter.BASE_PROMPT_FORMAT` after the BOS token.

    The engine owns its backend: :meth:`close` (or leaving a ``with LocalEngine(...)`` block)
    releases the model now; a script that never closes it has it released at interpreter exit.
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        evaluators: Sequence[EvaluatorSpec],
        *,
        evaluator: SpanEvaluator | None = None,
        deadline_ms: int = 1000,
        system_prompt: str | None = None,
    ) -> None:
        import xgrammar as xgr

        self.backend = backend
        self.tokenizer = tokenizer
        self.evaluators = tuple(evaluators)
        self.evaluator = evaluator
        self.deadline_ms = deadline_ms
        self.system_prompt = system_prompt
        self._xgr = xgr
        self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=backend.vocab_size, stop_token_ids=[backend.eos_token_id]
        )
        self._codec = TokenCodec.from_tokenizer(
            tokenizer, vocab_size=backend.vocab_size, tokenizer_info=self._tokenizer_info
        )
        self._compiler = xgr.GrammarCompiler(self._tokenizer_info, max_threads=1)
        self._specials = special_token_texts(tokenizer)
        self._compiled: dict[str, Any] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)

    def close(self) -> None:
        """Releases the backend's model (idempotent); the engine must not be used afterwards.

        The evaluator passed in stays open: its owner closes it (:class:`EvaluatorSetup`).
        """
        self.backend.close()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- request preparation --------------------------------------------------------------

    @property
    def chat(self) -> bool:
        """Whether prompts go through the tokenizer's chat template (false for a base model)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, prompt: str) -> list[int]:
        """The chat-templated prompt, ending with the assistant turn's opening; for a base
        model, BOS + system text + the question in the ``Question:``/``Answer:`` form."""
        if not self.chat:
            from engine_adapter._instructions import base_prompt

            text = base_prompt(prompt, self.system_prompt or "")
            ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
            bos = getattr(self.tokenizer, "bos_token_id", None)
            return [int(bos), *ids] if bos is not None else ids
        messages = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": prompt})
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(token) for token in ids]

    def span_grammar(
        self,
        mode: Mode | str,
        prefix: str = "",
        *,
        content_grammars: Mapping[str, str] | None = None,
    ) -> SpanGrammar:
        """The span grammar of this engine's evaluators for a mode and a forced prefix.

        Parameters:
            content_grammars: evaluator name → EBNF that replaces the evaluator's own input
                grammar inside its spans (a narrower language, e.g. only ``count("…", "…")``;
                the evaluator still evaluates the span with its full semantics).

        Raises:
            EngineError: no-grammar mode, an unknown evaluator, or a prefix the span grammar
                cannot express.
        """
        mode = _parse_mode(mode)
        if mode is Mode.NO_GRAMMAR:
            raise EngineError("no-grammar mode has no grammar")
        specs = list(self.evaluators)
        for name, ebnf in (content_grammars or {}).items():
            index = next((i for i, spec in enumerate(specs) if spec.name == name), None)
            if index is None:
                raise EngineError(f"no evaluator {name!r} in this engine's grammar")
            specs[index] = replace(specs[index], input_grammar=ebnf)
        try:
            return build_structural_tag(
                specs, mode, prefix=prefix or None, special_tokens=self._specials
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from exc

    def compile(self, grammar: SpanGrammar) -> Any:
        """The compiled grammar (``xgrammar.CompiledGrammar``), cached by the tag's JSON.

        Raises:
            EngineError: the tag does not compile (the message is XGrammar's).
        """
        key = grammar.json()
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = self._compiler.compile_structural_tag(key)
            except (RuntimeError, ValueError) as exc:
                raise EngineError(f"the span grammar does not compile: {exc}") from exc
            self._compiled[key] = compiled
        return compiled

    # -- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        *,
        mode: Mode | str = Mode.GRAMMAR_EVAL,
        prefix: str = "",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        grammar: SpanGrammar | None = None,
        evaluator: SpanEvaluator | None = None,
        on_text: TextCallback | None = None,
    ) -> GenerationResult:
        """Generates one answer.

        Parameters:
            prompt: the user message (the chat template is applied here).
            mode: ``no-grammar``, ``grammar-no-eval`` or ``grammar-eval``.
            prefix: text the answer is forced to begin with, passed through the model and the
                grammar (``"The expression is <calc>"`` enters a span at once).
            max_new_tokens: most tokens to *sample*; forced tokens do not count, and a result
                being injected is always completed.
            temperature: ``0`` for greedy decoding, else the softmax temperature.
            top_p: nucleus sampling mass (with ``temperature > 0``).
            seed: seeds the sampler; the same seed, prompt and backend give the same answer.
            stop: strings that end the answer once it contains one (after the prefix); the
                answer keeps the stop string (``"</result>"`` stops right after a result).
            grammar: the span grammar to use in the grammar modes instead of
                :meth:`span_grammar` ``(mode, prefix)`` — for instance one made with
                ``content_grammars``, or lowered from a request's ``evaluated_tag`` elements.
            evaluator: overrides the engine's evaluator for this request (benchmarks compare
                evaluators on one loaded model).
            on_text: streaming callback, called with each new piece of text.

        Raises:
            EngineError: the prefix does not fit the grammar, the prompt does not fit the
                context window, or ``grammar-eval`` without an evaluator.
        """
        mode = _parse_mode(mode)
        if max_new_tokens < 0:
            raise EngineError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise EngineError("temperature must be >= 0 and top_p in (0, 1]")
        evaluator = evaluator if evaluator is not None else self.evaluator
        if mode is Mode.GRAMMAR_EVAL and evaluator is None:
            raise EngineError("grammar-eval mode needs an evaluator (evald, inprocess or python)")
        started = time.perf_counter_ns()
        xgr = self._xgr
        backend = self.backend
        eos = backend.eos_token_id

        matcher: Any = None
        injector: Injector | None = None
        compile_us = 0
        if mode is not Mode.NO_GRAMMAR:
            t0 = time.perf_counter_ns()
            span_grammar = grammar if grammar is not None else self.span_grammar(mode, prefix)
            compiled = self.compile(span_grammar)
            compile_us = _us(t0)
            matcher = xgr.GrammarMatcher(compiled)
            # Without an evaluator the injector only records the spans the model writes.
            injector = Injector(
                self._codec,
                span_grammar.bindings,
                evaluator if mode is Mode.GRAMMAR_EVAL else None,
                deadline_ms=self.deadline_ms,
            )

        prompt_ids = self.prompt_ids(prompt)
        prefix_ids = (
            [int(t) for t in self.tokenizer.encode(prefix, add_special_tokens=False)]
            if prefix
            else []
        )
        detok = _Detokenizer(self.tokenizer)
        for prefix_token in prefix_ids:
            if matcher is not None and not matcher.accept_token(prefix_token):
                raise EngineError(
                    f"the prefix {prefix!r} does not fit the {mode.value} grammar (token "
                    f"{prefix_token} = {self.tokenizer.decode([prefix_token])!r} refused)"
                )
            if injector is not None:
                injector.accept_token(prefix_token)
        result = GenerationResult(
            text="",
            mode=mode.value,
            backend=backend.name,
            prompt_tokens=len(prompt_ids),
            reused_cache_tokens=0,
            token_ids=[],
            n_sampled=0,
            n_forced=len(prefix_ids),
            stop_reason="max_new_tokens",
            grammar_compile_us=compile_us,
        )
        if len(prompt_ids) + len(prefix_ids) + 1 > backend.n_ctx:
            raise EngineError(
                f"the prompt takes {len(prompt_ids) + len(prefix_ids)} tokens; the context "
                f"window holds {backend.n_ctx}"
            )

        # Prefill, reusing the longest prefix the KV cache already holds (at least one token
        # must be forwarded to get logits).
        full = prompt_ids + prefix_ids
        reuse = _common_prefix_len(backend.tokens, full)
        reuse = min(reuse, len(full) - 1)
        t0 = time.perf_counter_ns()
        backend.truncate(reuse)
        logits = backend.forward(full[reuse:])
        result.prefill_us = _us(t0)
        result.reused_cache_tokens = reuse
        result.steps.append(StepTiming("prefill", len(full) - reuse, result.prefill_us))
        emitted = detok.push(prefix_ids)
        if emitted and on_text is not None:
            on_text(emitted, True)
        prefix_len = len(detok.emitted)

        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
        decode_start = time.perf_counter_ns()
        span_count = 0
        while result.n_sampled < max_new_tokens:
            # 1. mask
            t0 = time.perf_counter_ns()
            if matcher is not None:
                matcher.fill_next_token_bitmask(self._bitmask)
                xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), self._bitmask)
            mask_us = _us(t0)
            # 2. sample
            t0 = time.perf_counter_ns()
            token = _sample(logits, temperature, top_p, generator)
            sample_us = _us(t0)
            if token is None:
                result.stop_reason = "grammar"
                break
            result.n_sampled += 1
            # 3. accept
            t0 = time.perf_counter_ns()
            if matcher is not None and not matcher.accept_token(token):
                # Cannot happen with a correct mask; stop rather than emit an illegal token.
                result.stop_reason = "grammar"
                break
            if token == eos:
                result.stop_reason = "eos"
                break
            if injector is not None:
                injector.accept_token(token)
            accept_us = _us(t0)
            emitted = detok.push([token])
            if emitted and on_text is not None:
                on_text(emitted, False)
            # 4. forced tokens: a closed span's result, all in the next forward. The value is
            # awaited first (bounded by the span deadline) so that the whole result text is
            # tokenized canonically in one piece rather than as "<result" + the rest.
            forced: list[int] = []
            wait_us = 0
            while injector is not None and injector.pending:
                t0 = time.perf_counter_ns()
                injector.wait()
                wait_us += _us(t0)
                more = injector.forced_tokens()
                if not more:
                    break
                for forced_token in more:
                    if not matcher.accept_token(forced_token):
                        raise RuntimeError(  # the injector promises grammar-legal tokens
                            f"the grammar refused forced token {forced_token}"
                        )
                    injector.accept_token(forced_token)
                forced.extend(more)
            if backend.n_tokens + 1 + len(forced) > backend.n_ctx:
                result.stop_reason = "context"
                break
            t0 = time.perf_counter_ns()
            logits = backend.forward([token, *forced])
            forward_us = _us(t0)
            result.steps.append(
                StepTiming(
                    "inject" if forced else "sample",
                    1 + len(forced),
                    forward_us,
                    mask_us,
                    sample_us,
                    accept_us,
                    wait_us,
                )
            )
            forced_at = -1
            if forced:
                result.n_forced += len(forced)
                forced_at = len(detok.ids)
                emitted = detok.push(forced)
                if emitted and on_text is not None:
                    on_text(emitted, True)
            if injector is not None and len(injector.spans) > span_count:
                for record in injector.spans[span_count:]:
                    result.spans.append(
                        SpanTiming(
                            evaluator=record.evaluator,
                            content=record.content,
                            forced_text=record.injected or "",
                            value=record.value,
                            error_code=record.error_code,
                            n_forced_tokens=len(forced),
                            wait_us=wait_us,
                            eval_latency_us=int((record.latency_ms or 0.0) * 1000),
                            inject_forward_us=forward_us if forced else 0,
                            step=result.n_sampled,
                            forced_at=forced_at,
                        )
                    )
                span_count = len(injector.spans)
            if matcher is not None and matcher.is_terminated():
                result.stop_reason = "eos"
                break
            if stop and _contains_stop(detok.emitted, stop, prefix_len):
                result.stop_reason = "stop"
                break
        result.token_ids = list(detok.ids)
        result.text = detok.text()
        if on_text is not None and result.text.startswith(detok.emitted):
            tail = result.text[len(detok.emitted) :]
            if tail:
                on_text(tail, False)
        result.decode_us = _us(decode_start)
        result.total_us = _us(started)
        return result


@dataclass
class EvaluatorSetup:
    """An evaluator plus the manifests of what it can evaluate (the grammar's evaluators)."""

    kind: str
    evaluator: SpanEvaluator
    evaluators: list[EvaluatorSpec]
    warning: str | None = None
    """Set when something is degraded but usable (evald not reachable at start-up)."""

    def close(self) -> None:
        close = getattr(self.evaluator, "close", None)
        if close is not None:
            close()


def open_evaluator(
    kind: str,
    *,
    target: str | None = None,
    token: str | None = None,
    names: Sequence[str] | None = None,
    connect_timeout_s: float = 5.0,
) -> EvaluatorSetup:
    """Opens the evaluator behind ``grammar-eval`` and lists the evaluators it offers.

    Parameters:
        kind: ``evald`` (the daemon, over one bidirectional stream), ``inprocess`` (the same
            WASM host inside this process) or ``python`` (the reference implementations).
        target, token: the daemon's address and bearer token (``evald`` only).
        names: restrict the grammar to these evaluators (default: every one offered).
        connect_timeout_s: how long to wait for the daemon at start-up.

    When the daemon cannot be reached, the standard manifests stand in for ``ListEvaluators``
    and :attr:`EvaluatorSetup.warning` says so: generation still runs, and every span gets
    ``<result_error>unavailable</result_error>`` until the daemon is back.

    Raises:
        EngineError: unknown ``kind``, or a requested name that is not offered.
    """
    from engine_adapter._client import EvaluatorClient, list_evaluators
    from engine_adapter._grammar import standard_evaluators
    from engine_adapter._inprocess import InProcessWasmEvaluator, ReferenceEvaluator

    warning = None
    evaluator: Any
    if kind == "evald":
        evaluator = EvaluatorClient(target, token)
        specs: list[EvaluatorSpec]
        try:
            specs = list_evaluators(evaluator.target, token, timeout_s=connect_timeout_s)
            evaluator.wait_connected(connect_timeout_s)
        except Exception as exc:  # unreachable or refused: degrade, never crash
            specs = standard_evaluators()
            warning = (
                f"evald at {evaluator.target} did not answer ({exc}); spans will get "
                "<result_error>unavailable</result_error> until it does. Start it with "
                "`evald serve`."
            )
    elif kind == "inprocess":
        from evald.contract import EvaldError

        try:
            evaluator = InProcessWasmEvaluator()
        except (EvaldError, OSError) as exc:
            raise EngineError(f"cannot load the standard WASM evaluators: {exc}") from exc
        specs = standard_evaluators(evaluator.names)
    elif kind == "python":
        specs = [spec for spec in standard_evaluators() if _has_reference(spec.name)]
        evaluator = ReferenceEvaluator([spec.name for spec in specs])
    else:
        raise EngineError(
            f"unknown evaluator mode {kind!r}; choose one of {', '.join(EVALUATOR_MODES)}"
        )
    if names is not None:
        by_name = {spec.name: spec for spec in specs}
        missing = [name for name in names if name not in by_name]
        if missing:
            close = getattr(evaluator, "close", None)
            if close is not None:
                close()
            raise EngineError(
                f"evaluator(s) {', '.join(missing)} not offered by {kind}; offered: "
                f"{', '.join(sorted(by_name))}"
            )
        specs = [by_name[name] for name in names]
    return EvaluatorSetup(kind, evaluator, specs, warning)


def _has_reference(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"evaluators_wasm.reference.{name}") is not None


def _parse_mode(mode: Mode | str) -> Mode:
    try:
        return Mode.parse(mode)
    except ValueError as exc:
        raise EngineError(str(exc)) from exc


def _contains_stop(text: str, stop: Sequence[str], start: int) -> bool:
    return any(needle and needle in text[start:] for needle in stop)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int | None:
    """Greedy (``temperature == 0``) or seeded nucleus sampling over masked logits; ``None``
    when every token is masked."""
    if temperature == 0:
        token = int(torch.argmax(logits))
        return None if logits[token] == float("-inf") else token
    probs = torch.softmax(logits / temperature, dim=-1)
    if not torch.isfinite(probs).all() or float(probs.sum()) <= 0:
        return None
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = int(torch.multinomial(sorted_probs, 1, generator=generator))
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
