"""The local CPU engine: one answer at a time over a real model, with the span grammar and
injection.

:class:`LocalEngine` holds what outlives a request (the backend and its KV cache, the tokenizer,
the compiled grammars) and prepares each request: the prompt's tokens, the grammar side
(:mod:`~engine_adapter.local._constraint`), the forced prefix. The decoding itself is
:class:`~engine_adapter.local._decode_loop.DecodeLoop`, timed by
:class:`~engine_adapter.local._timing.GenerationClock`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine_adapter.evaluation import TokenCodec, open_span_state
from engine_adapter.local._constraint import Constraint, SpanConstraint
from engine_adapter.local._decode_loop import DecodeLoop
from engine_adapter.local._errors import EngineError
from engine_adapter.local._result import GenerationResult, TextCallback
from engine_adapter.local._sampling import Sampler
from engine_adapter.local._timing import GenerationClock
from engine_adapter.spans import (
    ComputedSchemaError,
    EvaluatorSpec,
    Mode,
    SpanGrammar,
    build_structural_tag,
    lower_computed_schema,
    special_token_texts,
)

if TYPE_CHECKING:
    from engine_adapter.local._backend import Backend
    from engine_adapter.spans import SpanEvaluator

__all__ = ["LocalEngine"]

#: Compiled grammars kept by an engine (each mode and prefix is one; so is every grammar
#: narrowed to one request's operands).
_COMPILED_GRAMMARS_KEPT = 32


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
        # Least recently used last; bounded, since a grammar narrowed to a request's operands
        # is compiled for that request alone.
        self._compiled: OrderedDict[str, Any] = OrderedDict()
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

    # -- the engine-level runtime (engine_adapter.evaluation.EngineRuntime) ----------------

    @property
    def codec(self) -> TokenCodec:
        """The tokenizer's bytes, shared by every request of this engine."""
        return self._codec

    def flush(self) -> None:
        """Sends the engine's evaluator's submitted spans. The local engine decodes one request
        at a time, so its span states flush on each submission and nothing waits here."""
        if self.evaluator is not None:
            self.evaluator.flush()

    # -- request preparation --------------------------------------------------------------

    @property
    def chat(self) -> bool:
        """Whether prompts go through the tokenizer's chat template (false for a base model)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, prompt: str) -> list[int]:
        """The chat-templated prompt, ending with the assistant turn's opening; for a base
        model, BOS + system text + the question in the ``Question:``/``Answer:`` form."""
        if not self.chat:
            from engine_adapter.spans import base_prompt

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
        operands_from: str | None = None,
    ) -> SpanGrammar:
        """The span grammar of this engine's evaluators for a mode and a forced prefix.

        Parameters:
            content_grammars: evaluator name → EBNF that replaces the evaluator's own input
                grammar inside its spans (a narrower language, e.g. only ``count("…", "…")``;
                the evaluator still evaluates the span with its full semantics).
            operands_from: operands from the context: each evaluator's literal rules (its
                manifest's ``literals``) allow only the literals of this text
                (:func:`engine_adapter.narrow_to_operands`; the grammar's ``operands`` says
                what was narrowed, or why nothing was).

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
                specs,
                mode,
                prefix=prefix or None,
                special_tokens=self._specials,
                operands_from=operands_from,
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from exc

    def json_grammar(
        self, schema: Mapping[str, Any] | str, *, operands_from: str | None = None
    ) -> SpanGrammar:
        """The grammar of a JSON schema, its computed properties computed by this engine's
        evaluators (:func:`engine_adapter.lower_computed_schema`; docs/computed-fields.md).

        Parameters:
            operands_from: the text whose literals ``"extracted": true`` properties are
                narrowed to.

        Raises:
            EngineError: the schema is refused (the message starts with a JSON pointer into
                it).
        """
        try:
            return lower_computed_schema(schema, self.evaluators, operands_from=operands_from)
        except ComputedSchemaError as exc:
            raise EngineError(f"json schema: {exc}") from exc

    def compile(self, grammar: SpanGrammar) -> Any:
        """The compiled grammar (``xgrammar.CompiledGrammar``), cached by the tag's JSON (the
        32 used last).

        Raises:
            EngineError: the tag does not compile (the message is XGrammar's).
        """
        key = grammar.json()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
        if compiled is None:
            try:
                compiled = self._compiler.compile_structural_tag(key)
            except (RuntimeError, ValueError) as exc:
                raise EngineError(f"the span grammar does not compile: {exc}") from exc
            self._compiled[key] = compiled
            while len(self._compiled) > _COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
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
        operands_from: str | bool | None = None,
        json_schema: Mapping[str, Any] | str | None = None,
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
            operands_from: operands from the context (grammar modes): ``True`` narrows each
                evaluator's literal rules to the literals of ``prompt`` (numbers, words), a
                string to those of that text; see :meth:`span_grammar`. When the text holds
                none, the grammar is the usual one and ``GenerationResult.operands`` says why.
            json_schema: the answer is one JSON document of this schema; its ``computed``
                properties are computed and forced (:meth:`json_grammar`, docs/computed-fields.md).

        Raises:
            EngineError: the prefix does not fit the grammar, the prompt does not fit the
                context window, ``grammar-eval`` without an evaluator, or both ``grammar``
                and ``operands_from`` (a given grammar is used as it is).
        """
        mode = _parse_mode(mode)
        _check_sampling(max_new_tokens, temperature, top_p)
        evaluator = evaluator if evaluator is not None else self.evaluator
        grammar, ops = self._request_grammar(
            mode, prompt, grammar, operands_from, json_schema, evaluator
        )
        clock = GenerationClock()
        constraint, span_grammar = self._constraint(mode, prefix, grammar, evaluator, clock, ops)
        prompt_ids = self.prompt_ids(prompt)
        prefix_ids = self._prefix_ids(prefix)
        self._force_prefix(constraint, prefix, prefix_ids, mode)
        self._check_context(len(prompt_ids) + len(prefix_ids))
        sampler = Sampler(temperature, top_p, seed)
        loop = DecodeLoop(self.backend, self.tokenizer, constraint, sampler, clock, on_text)
        reused = loop.prefill(prompt_ids, prefix_ids)
        decoded = loop.run(max_new_tokens, stop)
        result = GenerationResult(
            text=decoded.text,
            mode=mode.value,
            backend=self.backend.name,
            prompt_tokens=len(prompt_ids),
            reused_cache_tokens=reused,
            token_ids=decoded.token_ids,
            n_sampled=decoded.n_sampled,
            n_forced=len(prefix_ids) + decoded.n_forced,
            stop_reason=decoded.stop_reason,
            spans=decoded.spans,
            operands=_operands_record(span_grammar),
        )
        clock.finish(result)
        return result

    def _request_grammar(
        self,
        mode: Mode,
        prompt: str,
        grammar: SpanGrammar | None,
        operands_from: str | bool | None,
        json_schema: Mapping[str, Any] | str | None,
        evaluator: SpanEvaluator | None,
    ) -> tuple[SpanGrammar | None, str | None]:
        """The request's own grammar (given, or a JSON schema's) and the operands text the
        engine's span grammar is still to be narrowed with; refuses grammar-eval without an
        evaluator where something is to be evaluated."""
        ops = _operands_text(prompt, operands_from, grammar)
        if json_schema is not None:
            if grammar is not None or mode is Mode.NO_GRAMMAR:
                raise EngineError("json_schema is a grammar of its own: no grammar or no-grammar")
            grammar, ops = self.json_grammar(json_schema, operands_from=ops), None
        needs_evaluator = grammar is None or grammar.computed is None or grammar.computed.fields
        if mode is Mode.GRAMMAR_EVAL and evaluator is None and needs_evaluator:
            raise EngineError("grammar-eval mode needs an evaluator (evald, inprocess or python)")
        return grammar, ops

    def _constraint(
        self,
        mode: Mode,
        prefix: str,
        grammar: SpanGrammar | None,
        evaluator: SpanEvaluator | None,
        clock: GenerationClock,
        operands_from: str | None = None,
    ) -> tuple[Constraint, SpanGrammar | None]:
        """The request's grammar side: none in no-grammar mode, else the span grammar (built
        and compiled, or from the cache) with a fresh matcher and injector."""
        if mode is Mode.NO_GRAMMAR:
            return Constraint(), None
        with clock.grammar_compile:
            span_grammar = (
                grammar
                if grammar is not None
                else self.span_grammar(mode, prefix, operands_from=operands_from)
            )
            compiled = self.compile(span_grammar)
        matcher = self._xgr.GrammarMatcher(compiled)
        # Without an evaluator the span state only records the spans the model writes.
        evaluating = evaluator if mode is Mode.GRAMMAR_EVAL else None
        injector = open_span_state(
            self, span_grammar.bindings, evaluating, computed=span_grammar.computed
        )
        return SpanConstraint(matcher, injector, self._bitmask), span_grammar

    def _prefix_ids(self, prefix: str) -> list[int]:
        if not prefix:
            return []
        return [int(t) for t in self.tokenizer.encode(prefix, add_special_tokens=False)]

    def _force_prefix(
        self, constraint: Constraint, prefix: str, prefix_ids: Sequence[int], mode: Mode
    ) -> None:
        """Feeds the prefix to the grammar and the injector, before any forward.

        Raises:
            EngineError: the grammar refuses one of the prefix's tokens.
        """
        for token in prefix_ids:
            if not constraint.accept(token):
                raise EngineError(
                    f"the prefix {prefix!r} does not fit the {mode.value} grammar (token "
                    f"{token} = {self.tokenizer.decode([token])!r} refused)"
                )
            constraint.follow(token)

    def _check_context(self, n_tokens: int) -> None:
        """Refuses a prompt and prefix that leave no room for one sampled token."""
        if n_tokens + 1 > self.backend.n_ctx:
            raise EngineError(
                f"the prompt takes {n_tokens} tokens; the context window holds {self.backend.n_ctx}"
            )


def _parse_mode(mode: Mode | str) -> Mode:
    try:
        return Mode.parse(mode)
    except ValueError as exc:
        raise EngineError(str(exc)) from exc


def _check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuses sampling options no decode loop can honour, before anything is compiled."""
    if max_new_tokens < 0:
        raise EngineError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise EngineError("temperature must be >= 0 and top_p in (0, 1]")


def _operands_text(
    prompt: str, operands_from: str | bool | None, grammar: SpanGrammar | None
) -> str | None:
    """The text whose literals narrow the grammar (``True``: the prompt's), or None.

    A given grammar is used as it is, so narrowing it is refused rather than ignored.
    """
    operands_text = prompt if operands_from is True else operands_from or None
    if grammar is not None and operands_text is not None:
        raise EngineError(
            "operands_from narrows the engine's span grammar; pass it to span_grammar() "
            "when you give a grammar of your own"
        )
    return operands_text


def _operands_record(span_grammar: SpanGrammar | None) -> dict[str, Any] | None:
    """What operands narrowing did, as the result reports it (None when not asked for)."""
    if span_grammar is None or span_grammar.operands is None:
        return None
    return span_grammar.operands.to_dict()
