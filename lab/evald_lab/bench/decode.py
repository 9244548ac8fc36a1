"""``engine-adapter bench decode`` (also ``evald bench decode``): decoding with spans, end to end.

Three measurements on the local CPU engine (SmolLM2-135M-Instruct on llama.cpp), with the evald
daemon started here on a private unix socket:

1. **Decode** — the same prompts (arithmetic and letter counting, each answer forced to open a
   span, as in the accuracy study) with the same sampling seeds, once per evaluator mode, in
   interleaved order: ``none`` (results known in advance: the same tokens are forced, nothing is
   evaluated — the floor), ``python`` (the reference implementations in this process),
   ``inprocess`` (evald's WASM host in this process) and ``evald`` (the daemon, one connection
   on its data path, as an engine uses it; the gRPC stream's cost is in ``bench overhead``).
   Reported: tokens/s, the time each span added over ``none`` (paired by prompt and repeat),
   the time the engine was blocked on each result, and how many forwards each injected result
   cost (one: the local engine forwards the closing token and the whole result together; a
   model writing the result itself spends one forward per token).
2. **Tool-call baseline** — the same prompts done the way a tool call works: generate until the
   span closes (``</calc>``), stop, evaluate through evald, then submit the whole context plus
   the result as a new generation and sample its first token. Per span: from the moment the
   span closed until the next token is sampled, in the loop vs as a tool call (with the KV cache
   emptied, and with the engine's prefix cache).
3. **Batch stall** — N sequences decoding in lockstep (one forward per sequence per step; the
   local engine holds one sequence per llama.cpp context), sharing one
   :class:`~engine_adapter.EvaluatorClient` that sends every span closed in a step in one
   message. In the slow run one sequence's spans go to a tenant module that spins until its
   deadline (registered on the daemon as ``slowcalc``). Two engine policies: ``skip`` (a
   sequence whose result is not ready sits out the step; the others go on) and ``wait`` (the
   step waits for it, bounded by the deadline — what SGLang's grammar object does today). The
   other sequences' step time is their own work plus any time the step was blocked; the stall
   ratio is that time with the slow span over that time without it.

The GPU variant (SGLang, several batch sizes) is ``deploy/gpu-check.sh``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_adapter import EvalResult

__all__ = ["PROFILES", "DecodeProfile", "run_decode"]

#: The slow tenant module of the batch-stall run: ABI v1, spins until stopped by its deadline.
SLOW_EVALUATOR = "slowcalc"


@dataclass(frozen=True)
class DecodeProfile:
    """How much to measure."""

    name: str
    prompts_per_task: int
    repeats: int
    max_new_tokens: int
    """Tokens sampled per answer (the span opens at once: the prefix ends with its tag)."""
    stall_sequences: int
    stall_steps: int
    stall_repeats: int
    stall_deadline_ms: int
    temperature: float = 0.0
    seed: int = 20240601


PROFILES: dict[str, DecodeProfile] = {
    "tiny": DecodeProfile(
        name="tiny",
        prompts_per_task=1,
        repeats=1,
        max_new_tokens=18,
        stall_sequences=2,
        stall_steps=26,
        stall_repeats=1,
        stall_deadline_ms=100,
    ),
    "full": DecodeProfile(
        name="full",
        prompts_per_task=3,
        repeats=3,
        max_new_tokens=28,
        stall_sequences=4,
        stall_steps=40,
        stall_repeats=2,
        stall_deadline_ms=400,
    ),
}

MODES = ("none", "python", "inprocess", "evald")

_DAEMON_CONFIG = """
[server]
max_batch_items = 4096
log_level = "warning"
shutdown_grace_s = 2

[[tenants]]
name = "local"
evaluators = ["*"]
allow_register = true
[tenants.limits]
# Unmetered fuel: the slow module must run until its deadline, not run out of fuel first.
fuel = 0
deadline_ms = 5000
max_concurrency = 100000
"""


class _KnownResults:
    """The ``none`` mode: results computed once beforehand (by the Python reference), handed
    out at once on submit. The model's tokens and the forced tokens are exactly those of the
    other modes; only the evaluation is missing."""

    def __init__(self) -> None:
        from evaluators_wasm.reference import GuestError, reference

        self._reference = reference
        self._guest_error = GuestError
        self._known: dict[tuple[str, str], EvalResult] = {}

    def learn(self, evaluator: str, content: str) -> None:
        key = (evaluator, content)
        if key in self._known:
            return
        try:
            value = self._reference(evaluator)(content.encode("utf-8", "surrogateescape"))
            self._known[key] = EvalResult(value)
        except self._guest_error as exc:
            self._known[key] = EvalResult(None, exc.code, exc.message)

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        self.learn(evaluator, content)
        future: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        future.set_result(self._known[evaluator, content])
        return future

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


#: The benchmark measures what a span costs, so every letters prompt must write one: its spans
#: are narrowed to ``count("WORD", "L")`` (without instructions, SmolLM2 rarely closes a span in
#: the full ``strop`` language). The accuracy study does not narrow.
_BENCH_CONTENT_GRAMMAR = {"letters": 'root ::= "count(\\"" [a-zA-Z]+ "\\", \\"" [a-zA-Z] "\\")"'}


@dataclass
class _Item:
    task: str
    prompt: str
    prefix: str
    evaluator: str
    seed: int
    grammar: Any = None
    grammar_no_eval: Any = None
    closing: str = ""


def _box_problems(n: int, seed: int) -> list[tuple[str, str]]:
    """``(task, prompt)`` box problems with seeded numbers: the benchmark's arithmetic prompts,
    fixed so that its numbers stay comparable (SmolLM2 closes these spans within the tiny
    profile's steps; the accuracy study's wordings are wider, see ``_study_items``)."""
    rng = random.Random(f"arithmetic:{seed}")
    out = []
    for _ in range(n):
        rows, per_row, added = rng.randint(3, 40), rng.randint(3, 40), rng.randint(2, 99)
        out.append((
            "arithmetic",
            f"A box has {rows} rows of {per_row} items, then {added} more are added. "
            "How many items are in the box?",
        ))
    return out


def _items(engine: Any, profile: DecodeProfile) -> list[_Item]:
    from evald_lab.study.run import TASK_EVALUATOR, TASK_PREFIX, letter_items

    items: list[_Item] = []
    questions = _box_problems(profile.prompts_per_task, profile.seed) + [
        (item.task, item.prompt) for item in letter_items(profile.prompts_per_task, profile.seed)
    ]
    for index, (task, prompt) in enumerate(questions):
        content = (
            {TASK_EVALUATOR[task]: _BENCH_CONTENT_GRAMMAR[task]}
            if task in _BENCH_CONTENT_GRAMMAR
            else None
        )
        prefix = TASK_PREFIX[task]
        evaluator = TASK_EVALUATOR[task]
        item = _Item(task, prompt, prefix, evaluator, profile.seed + index)
        item.grammar = engine.span_grammar("grammar-eval", prefix, content_grammars=content)
        item.grammar_no_eval = engine.span_grammar(
            "grammar-no-eval", prefix, content_grammars=content
        )
        binding = next(b for b in item.grammar.bindings if b.evaluator == evaluator)
        item.closing = binding.end
        items.append(item)
    return items


def _generate(engine: Any, item: _Item, profile: DecodeProfile, evaluator: Any) -> Any:
    return engine.generate(
        item.prompt,
        mode="grammar-eval",
        prefix=item.prefix,
        max_new_tokens=profile.max_new_tokens,
        temperature=profile.temperature,
        seed=item.seed,
        grammar=item.grammar,
        evaluator=evaluator,
    )


# -- 1. decode ----------------------------------------------------------------------------


@dataclass
class _ModeTally:
    decode_us: list[int] = field(default_factory=list)
    tokens: int = 0
    sampled: int = 0
    forwards: int = 0
    spans: int = 0
    span_wait_us: list[int] = field(default_factory=list)
    span_eval_us: list[int] = field(default_factory=list)
    forced_per_span: list[int] = field(default_factory=list)
    inject_steps: int = 0
    sample_forward_us: list[int] = field(default_factory=list)
    in_loop_span_us: list[int] = field(default_factory=list)
    eval_cost_us: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    token_ids: dict[tuple[int, int], list[int]] = field(default_factory=dict)


def _in_loop_span_us(result: Any) -> list[int]:
    """Per span: blocked on the value + the forward carrying the result + masking and sampling
    the next token (from the span closing to the next token being chosen)."""
    out = []
    steps = result.steps
    for index, step in enumerate(steps):
        if step.kind != "inject":
            continue
        following = steps[index + 1] if index + 1 < len(steps) else None
        next_us = (following.mask_us + following.sample_us) if following is not None else 0
        out.append(step.wait_us + step.forward_us + next_us)
    return out


def _record(tally: _ModeTally, result: Any, key: tuple[int, int]) -> None:
    tally.decode_us.append(result.decode_us)
    tally.tokens += result.n_sampled + result.n_forced
    tally.sampled += result.n_sampled
    tally.forwards += result.n_forwards
    tally.token_ids[key] = list(result.token_ids)
    for span in result.spans:
        tally.spans += 1
        tally.span_wait_us.append(span.wait_us)
        tally.span_eval_us.append(span.eval_latency_us)
        tally.forced_per_span.append(span.n_forced_tokens)
        if span.error_code:
            tally.errors[span.error_code] = tally.errors.get(span.error_code, 0) + 1
    inject_steps = [s for s in result.steps if s.kind == "inject"]
    tally.inject_steps += len(inject_steps)
    # What the evaluation cost the loop: the closing token's accept (which submits the span)
    # plus the time blocked on its value.
    tally.eval_cost_us.extend(s.accept_us + s.wait_us for s in inject_steps)
    tally.sample_forward_us.extend(s.forward_us for s in result.steps if s.kind == "sample")
    tally.in_loop_span_us.extend(_in_loop_span_us(result))


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _run_decode_modes(
    engine: Any,
    items: Sequence[_Item],
    profile: DecodeProfile,
    evaluators: dict[str, Any],
    bars: Any,
) -> dict[str, Any]:
    tallies = {mode: _ModeTally() for mode in MODES}
    bars.task("decode", len(items) * (1 + profile.repeats * len(MODES)))
    # Untimed pass: compiles the grammars, warms the caches, teaches ``none`` the results.
    for item in items:
        bars.describe("decode", f"decode warm-up: {item.task}")
        warm = _generate(engine, item, profile, evaluators["python"])
        for span in warm.spans:
            evaluators["none"].learn(span.evaluator, span.content)
        bars.advance("decode")
    for repeat in range(profile.repeats):
        for index, item in enumerate(items):
            shift = (repeat + index) % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                bars.describe("decode", f"decode r{repeat + 1}: {mode} {item.task}")
                result = _generate(engine, item, profile, evaluators[mode])
                _record(tallies[mode], result, (repeat, index))
                bars.advance("decode")
    baseline = tallies["none"]
    base_cost = _mean([us / 1000 for us in baseline.eval_cost_us]) or 0.0
    modes: list[dict[str, Any]] = []
    for mode in MODES:
        tally = tallies[mode]
        decode_s = sum(tally.decode_us) / 1e6
        spans_per_generation = tally.spans / max(1, len(tally.decode_us))
        paired = [
            (mine - base) / 1000 / spans_per_generation
            for mine, base in zip(tally.decode_us, baseline.decode_us, strict=True)
            if spans_per_generation
        ]
        cost = _mean([us / 1000 for us in tally.eval_cost_us])
        modes.append(
            {
                "mode": mode,
                "generations": len(tally.decode_us),
                "tokens": tally.tokens,
                "sampled_tokens": tally.sampled,
                "forwards": tally.forwards,
                "tokens_per_s": round(tally.tokens / decode_s, 2) if decode_s else 0.0,
                "decode_ms_mean": _mean([us / 1000 for us in tally.decode_us]),
                "spans": tally.spans,
                "span_errors": tally.errors,
                "eval_cost_ms_per_span_mean": cost,
                "added_ms_per_span": round(cost - base_cost, 3) if cost is not None else None,
                "decode_delta_ms_per_span_median": _median(paired) if mode != "none" else 0.0,
                "blocked_ms_per_span_mean": _mean([us / 1000 for us in tally.span_wait_us]),
                "blocked_ms_per_span_median": _median([us / 1000 for us in tally.span_wait_us]),
                "blocked_ms_per_span_max": (
                    round(max(tally.span_wait_us) / 1000, 3) if tally.span_wait_us else None
                ),
                "eval_latency_ms_per_span_mean": _mean([us / 1000 for us in tally.span_eval_us]),
                "forwards_per_injected_result": (
                    round(tally.inject_steps / tally.spans, 3) if tally.spans else None
                ),
                "forced_tokens_per_result_mean": _mean(tally.forced_per_span),
                "forward_ms_per_sample_step_median": _median(
                    [us / 1000 for us in tally.sample_forward_us]
                ),
                "same_tokens_as_none": all(
                    tally.token_ids.get(key) == ids for key, ids in baseline.token_ids.items()
                ),
            }
        )
    by_mode = {m["mode"]: m for m in modes}
    python_tps = by_mode["python"]["tokens_per_s"]
    # The same ratio with the forward passes' noise taken out: every mode decodes the same
    # tokens, so its decode time is a common part plus what its evaluations cost the loop.
    costs = {mode: sum(tallies[mode].eval_cost_us) for mode in MODES}
    common = statistics.fmean(sum(tallies[m].decode_us) - costs[m] for m in MODES)
    attributed = (common + costs["python"]) / (common + costs["evald"]) if common > 0 else None
    return {
        "modes": modes,
        "evald_vs_python_tokens_per_s": (
            round(by_mode["evald"]["tokens_per_s"] / python_tps, 4) if python_tps else None
        ),
        "evald_vs_python_tokens_per_s_attributed": (
            round(attributed, 4) if attributed is not None else None
        ),
        "in_loop_span_ms": _mean([us / 1000 for us in tallies["evald"].in_loop_span_us]),
        "_in_loop_span_us": tallies["evald"].in_loop_span_us,
    }


# -- 2. the tool-call baseline ------------------------------------------------------------


def _toolcall_once(
    engine: Any, item: _Item, profile: DecodeProfile, client: Any, *, cached: bool
) -> float | None:
    """One span done as a tool call; returns ms from the span closing to the next token
    being sampled (None when the model did not close the span within its budget)."""
    first = engine.generate(
        item.prompt,
        mode="grammar-no-eval",
        prefix=item.prefix,
        max_new_tokens=profile.max_new_tokens,
        temperature=profile.temperature,
        seed=item.seed,
        stop=(item.closing,),
        grammar=item.grammar_no_eval,
    )
    closed_at = time.perf_counter()
    at = first.text.find(item.closing, len(item.prefix) - len(item.closing))
    if at < 0:
        return None
    context = first.text[: at + len(item.closing)]
    content = context[len(item.prefix) : at]
    future = client.submit(item.evaluator, content, engine.deadline_ms)
    client.flush()
    result = future.result(timeout=engine.deadline_ms / 1000 + 5)
    binding = next(b for b in item.grammar.bindings if b.evaluator == item.evaluator)
    # The injector's own rendering rule: the value, or the error code, in its tags.
    if result.value is not None and result.error_code is None:
        rendered = binding.result_begin + result.value + binding.result_end
    else:
        rendered = binding.error_begin + (result.error_code or "internal") + binding.error_end
    # The whole context plus the result, as a new request. Its grammar is the same span grammar
    # (compiled once): the resubmitted text passes through it like any forced prefix.
    resubmit = context + rendered
    if not cached:
        engine.backend.reset()
    second = engine.generate(
        item.prompt,
        mode="grammar-no-eval",
        prefix=resubmit,
        max_new_tokens=1,
        temperature=profile.temperature,
        seed=item.seed,
        grammar=item.grammar_no_eval,
    )
    elapsed_ms = (time.perf_counter() - closed_at) * 1000
    # generate() forwards the token it sampled: that forward belongs to the next step.
    last = second.steps[-1] if second.steps and second.steps[-1].kind == "sample" else None
    compile_ms = second.grammar_compile_us / 1000
    return float(elapsed_ms - (last.forward_us / 1000 if last else 0.0) - compile_ms)


def _run_toolcall(
    engine: Any,
    items: Sequence[_Item],
    profile: DecodeProfile,
    client: Any,
    in_loop_span_us: Sequence[int],
    bars: Any,
) -> dict[str, Any]:
    full: list[float] = []
    cached: list[float] = []
    bars.task("tool-call", len(items) * (1 + 2 * profile.repeats))
    for item in items:  # warm: compiles the resubmission grammars
        bars.describe("tool-call", f"tool-call warm-up: {item.task}")
        _toolcall_once(engine, item, profile, client, cached=True)
        bars.advance("tool-call")
    for repeat in range(profile.repeats):
        for index, item in enumerate(items):
            order = (False, True) if (repeat + index) % 2 == 0 else (True, False)
            for use_cache in order:
                bars.describe("tool-call", f"tool-call r{repeat + 1}: {item.task}")
                span_ms = _toolcall_once(engine, item, profile, client, cached=use_cache)
                if span_ms is not None:
                    (cached if use_cache else full).append(span_ms)
                bars.advance("tool-call")
    in_loop = _mean([us / 1000 for us in in_loop_span_us])
    full_ms, cached_ms = _mean(full), _mean(cached)
    return {
        "spans": len(full),
        "in_loop_span_ms": in_loop,
        "toolcall_span_ms": full_ms,
        "toolcall_cached_span_ms": cached_ms,
        "in_loop_vs_toolcall": round(in_loop / full_ms, 4) if in_loop and full_ms else None,
        "in_loop_vs_toolcall_cached": (
            round(in_loop / cached_ms, 4) if in_loop and cached_ms else None
        ),
        "toolcall_span_ms_median": _median(full),
        "toolcall_cached_span_ms_median": _median(cached),
    }


# -- 3. the batch stall -------------------------------------------------------------------


class _Sequence:
    """One sequence of the lockstep batch: its own llama.cpp context, matcher and injector.

    It answers its prompt with the forced span prefix, samples greedily up to ``max_tokens``
    (or, with ``restart_after_span``, until its span's result is in), then starts over (a
    restart is not a decode step and is not timed).
    """

    def __init__(
        self,
        engine: Any,
        backend: Any,
        codec: Any,
        item: _Item,
        client: Any,
        *,
        evaluator_name: str,
        deadline_ms: int,
        max_tokens: int,
        restart_after_span: bool = False,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._engine = engine
        self._backend = backend
        self._codec = codec
        self._client = client
        self._compiled = engine.compile(item.grammar)
        self._bindings = tuple(
            dataclasses.replace(b, evaluator=evaluator_name) if b.evaluator == item.evaluator else b
            for b in item.grammar.bindings
        )
        self._deadline_ms = deadline_ms
        self._max_tokens = max_tokens
        self._restart_after_span = restart_after_span
        self._prompt_ids = engine.prompt_ids(item.prompt)
        self._prefix_ids = [
            int(t) for t in engine.tokenizer.encode(item.prefix, add_special_tokens=False)
        ]
        self._bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
        self.spans = 0
        self.injected_forwards = 0
        self.idle_steps = 0
        self._restart()

    def _restart(self) -> None:
        from engine_adapter import Injector

        self._matcher = self._xgr.GrammarMatcher(self._compiled)
        self._injector = Injector(
            self._codec,
            self._bindings,
            self._client,
            deadline_ms=self._deadline_ms,
            auto_flush=False,
        )
        for token in self._prefix_ids:
            self._matcher.accept_token(token)
            self._injector.accept_token(token)
        self._backend.truncate(0)
        self._logits = self._backend.forward(self._prompt_ids + self._prefix_ids)
        self._sampled = 0
        self._span_count = 0

    def _feed(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused forced token {token}")
            self._injector.accept_token(token)

    def step(self, policy: str) -> tuple[str, int]:
        """One decode step; returns (kind, ns blocked on an evaluation).

        Kinds: ``sample``, ``forced`` (only forced tokens forwarded), ``idle`` (``skip``
        policy, result not ready: no forward), ``restart`` (answer done; not a decode step).
        """
        injector = self._injector
        blocked = 0
        if injector.pending:
            slack = injector.forced_tokens()
            if not slack and policy == "wait":
                started = time.perf_counter_ns()
                injector.wait()
                blocked = time.perf_counter_ns() - started
                slack = injector.forced_tokens()
            if not slack:
                self.idle_steps += 1
                return "idle", blocked
            self._feed(slack)
            self._logits = self._backend.forward(slack)
            self.injected_forwards += 1
            self._count_spans()
            return "forced", blocked
        if (
            self._sampled >= self._max_tokens
            or self._matcher.is_terminated()
            or (self._restart_after_span and self._span_count > 0)
        ):
            self._restart()
            return "restart", 0
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(self._logits.unsqueeze(0), self._bitmask)
        token = int(self._logits.argmax())
        self._sampled += 1
        if token == self._backend.eos_token_id or not self._matcher.accept_token(token):
            self._restart()
            return "restart", 0
        injector.accept_token(token)
        forced: list[int] = []
        if injector.pending:
            if policy == "wait":
                while injector.pending:
                    started = time.perf_counter_ns()
                    injector.wait()
                    blocked += time.perf_counter_ns() - started
                    more = injector.forced_tokens()
                    if not more:
                        break
                    self._feed(more)
                    forced.extend(more)
            else:
                forced = injector.forced_tokens()  # the value-independent "<result" slack
                self._feed(forced)
            self.injected_forwards += 1 if forced else 0
        self._logits = self._backend.forward([token, *forced])
        self._count_spans()
        return "sample", blocked

    def _count_spans(self) -> None:
        spans = len(self._injector.spans)
        if spans > self._span_count:
            self.spans += spans - self._span_count
            self._span_count = spans


@dataclass
class _StallSamples:
    """Per step of one kind of run (policy x with/without the slow span), over its repeats."""

    own_ms: list[float] = field(default_factory=list)
    blocked_ms: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)
    sequence_0_spans: int = 0
    sequence_0_idle_steps: int = 0
    spans: int = 0
    injected_forwards: int = 0

    def summary(self) -> dict[str, Any]:
        own = _median(self.own_ms) or 0.0
        blocked = _mean(self.blocked_ms) or 0.0
        return {
            # The others' step: their own work (median: robust to the neighbours' bursts) plus
            # the mean time a step stood blocked on sequence 0's evaluation (a batched engine's
            # step is shared by every sequence in it).
            "other_step_ms": round(own + blocked, 3),
            "other_own_ms_median": own,
            "other_own_ms_mean": _mean(self.own_ms),
            "blocked_ms_per_step_mean": round(blocked, 3),
            "blocked_ms_max": round(max(self.blocked_ms), 3) if self.blocked_ms else None,
            "other_step_ms_raw_mean": _mean(
                [o + b for o, b in zip(self.own_ms, self.blocked_ms, strict=True)]
            ),
            "round_ms_mean": _mean(self.round_ms),
            "steps": len(self.round_ms),
            "steps_blocked_on_sequence_0": sum(1 for b in self.blocked_ms if b > 0),
            "sequence_0_spans": self.sequence_0_spans,
            "sequence_0_idle_steps": self.sequence_0_idle_steps,
            "spans": self.spans,
            "forwards_per_injected_result": (
                round(self.injected_forwards / self.spans, 3) if self.spans else None
            ),
        }


def _stall_run(
    engine: Any,
    backends: Sequence[Any],
    codec: Any,
    items: Sequence[_Item],
    client: Any,
    profile: DecodeProfile,
    samples: _StallSamples,
    *,
    policy: str,
    slow: bool,
) -> None:
    sequences = []
    for index, backend in enumerate(backends):
        item = items[index % len(items)]
        slow_one = slow and index == 0
        sequences.append(
            _Sequence(
                engine,
                backend,
                codec,
                item,
                client,
                evaluator_name=SLOW_EVALUATOR if slow_one else item.evaluator,
                deadline_ms=profile.stall_deadline_ms if slow_one else engine.deadline_ms,
                max_tokens=profile.max_new_tokens,
                # Sequence 0 starts over as soon as its result is in: a span (slow, in the
                # slow run) is in flight for much of the run.
                restart_after_span=index == 0,
            )
        )
    for _ in range(profile.stall_steps):
        round_started = time.perf_counter_ns()
        own_ns = 0
        counted = 0
        blocked_ns = 0
        for index, sequence in enumerate(sequences):
            started = time.perf_counter_ns()
            kind, blocked = sequence.step(policy)
            elapsed = time.perf_counter_ns() - started
            if index == 0:
                blocked_ns = blocked
            elif kind != "restart":
                own_ns += elapsed
                counted += 1
        client.flush()  # every span closed in this step, in one message
        samples.round_ms.append((time.perf_counter_ns() - round_started) / 1e6)
        if counted:
            samples.own_ms.append(own_ns / counted / 1e6)
            samples.blocked_ms.append(blocked_ns / 1e6)
    samples.sequence_0_spans += sequences[0].spans
    samples.sequence_0_idle_steps += sequences[0].idle_steps
    samples.spans += sum(s.spans for s in sequences)
    samples.injected_forwards += sum(s.injected_forwards for s in sequences)


def _run_stall(
    engine: Any,
    items: Sequence[_Item],
    profile: DecodeProfile,
    client: Any,
    bars: Any,
) -> dict[str, Any]:
    from engine_adapter import TokenCodec
    from engine_adapter.local import load_backend

    calc_items = [item for item in items if item.evaluator == "calc"] or list(items)
    codec = TokenCodec.from_tokenizer(engine.tokenizer, vocab_size=engine.backend.vocab_size)
    policies = ("skip", "wait")
    bars.task("stall", profile.stall_sequences + len(policies) * 2 * profile.stall_repeats)
    bars.describe("stall", "batch stall: loading one context per sequence")
    backends = []
    try:
        for _ in range(profile.stall_sequences):
            backends.append(load_backend("llama", n_ctx=512))
            bars.advance("stall")
        runs = {(policy, slow): _StallSamples() for policy in policies for slow in (False, True)}
        for repeat in range(profile.stall_repeats):
            for policy in policies:
                order = (False, True) if repeat % 2 == 0 else (True, False)
                for slow in order:
                    bars.describe("stall", f"batch stall r{repeat + 1}: {policy}, slow={slow}")
                    _stall_run(
                        engine,
                        backends,
                        codec,
                        calc_items,
                        client,
                        profile,
                        runs[policy, slow],
                        policy=policy,
                        slow=slow,
                    )
                    bars.advance("stall")
    finally:
        for backend in backends:
            backend.close()
    out = []
    for policy in policies:
        merged = {run: runs[policy, run == "slow"].summary() for run in ("baseline", "slow")}
        base = merged["baseline"]["other_step_ms"]
        slow_ms = merged["slow"]["other_step_ms"]
        raw_base = merged["baseline"]["other_step_ms_raw_mean"]
        raw_slow = merged["slow"]["other_step_ms_raw_mean"]
        out.append(
            {
                "policy": policy,
                **merged,
                "stall_ratio": round(slow_ms / base, 4) if base and slow_ms else None,
                "stall_ratio_raw_mean": (
                    round(raw_slow / raw_base, 4) if raw_base and raw_slow else None
                ),
                "round_ratio": (
                    round(merged["slow"]["round_ms_mean"] / merged["baseline"]["round_ms_mean"], 4)
                    if merged["baseline"]["round_ms_mean"]
                    else None
                ),
            }
        )
    return {
        "sequences": profile.stall_sequences,
        "steps_per_run": profile.stall_steps,
        "repeats": profile.stall_repeats,
        "slow_deadline_ms": profile.stall_deadline_ms,
        "policies": out,
    }


# -- the run ------------------------------------------------------------------------------


def _slow_module() -> bytes:
    from evald.testing import guest, manifest_bytes

    return guest(
        "loop",
        manifest=manifest_bytes(
            name=SLOW_EVALUATOR,
            tag=SLOW_EVALUATOR,
            semantics_version=f"{SLOW_EVALUATOR}/1",
            description="Benchmark module: spins until its deadline stops it.",
        ),
    )


def run_decode(
    profile: DecodeProfile | str = "full",
    *,
    out_dir: Path = Path("reports/bench"),
    show_progress: bool = True,
    plot: bool = True,
    parts: Sequence[str] = ("decode", "toolcall", "stall"),
) -> dict[str, Any]:
    """Runs the decode benchmark; writes ``decode.json`` (and ``decode.png``) under ``out_dir``
    and returns the result document.

    Raises:
        KeyError: an unknown profile name.
        RuntimeError: the daemon did not start (its log is in the message).
        engine_adapter.local._backend.BackendError: the model or llama.cpp is not installed.
    """
    from engine_adapter import (
        EvaluatorClient,
        InProcessWasmEvaluator,
        ReferenceEvaluator,
        standard_evaluators,
    )
    from engine_adapter.local import LocalEngine, load_backend, load_tokenizer
    from evald.client import Client
    from evald.testing import start_daemon
    from evald_lab.bench._common import (
        SCHEMA_VERSION,
        Progress,
        load_average,
        machine_info,
        write_json,
    )

    if isinstance(profile, str):
        profile = PROFILES[profile]
    machine = machine_info()
    started = time.perf_counter()
    document: dict[str, Any] = {
        "benchmark": "decode",
        "schema": SCHEMA_VERSION,
        "profile": profile.name,
        "settings": dataclasses.asdict(profile),
        "engine": "local CPU engine, SmolLM2-135M-Instruct Q4_1 on llama.cpp",
        "gpu_variant": "deploy/gpu-check.sh",
    }
    with Progress(show_progress) as bars, tempfile.TemporaryDirectory(prefix="evald-bench-") as tmp:
        bars.task("setup", 3)
        bars.describe("setup", "decode: starting evald")
        data_target = f"unix:{Path(tmp) / 'data.sock'}"
        daemon: Any = start_daemon(
            Path(tmp),
            _DAEMON_CONFIG.replace("[server]\n", f'[server]\ndata_listen = "{data_target}"\n', 1),
        )
        bars.advance("setup")
        evaluators: dict[str, Any] = {}
        backend = None
        try:
            with Client(daemon.target) as control:
                control.register(_slow_module())
            bars.describe("setup", "decode: loading the model")
            backend = load_backend("llama", n_ctx=2048)
            # Span deadlines far from the cost (a loaded machine can stall a thread for a second);
            # the stall run's slow sequence sets its own, short one.
            engine = LocalEngine(
                backend,
                load_tokenizer(),
                standard_evaluators(["calc", "strop"]),
                deadline_ms=5000,
            )
            bars.advance("setup")
            evaluators = {
                "none": _KnownResults(),
                "python": ReferenceEvaluator(["calc", "strop"]),
                "inprocess": InProcessWasmEvaluator(),
                "evald": EvaluatorClient(daemon.target, data_target=data_target),
            }
            if not evaluators["evald"].wait_connected(30):
                raise RuntimeError(f"cannot connect to the daemon's data path at {data_target}")
            items = _items(engine, profile)
            bars.advance("setup")
            in_loop: list[int] = []
            if "decode" in parts:
                decode = _run_decode_modes(engine, items, profile, evaluators, bars)
                in_loop = decode.pop("_in_loop_span_us")
                document["decode"] = decode
            if "toolcall" in parts:
                if not in_loop:
                    for item in items:
                        in_loop.extend(
                            _in_loop_span_us(_generate(engine, item, profile, evaluators["evald"]))
                        )
                document["toolcall"] = _run_toolcall(
                    engine, items, profile, evaluators["evald"], in_loop, bars
                )
            if "stall" in parts:
                document["stall"] = _run_stall(engine, items, profile, evaluators["evald"], bars)
        finally:
            for evaluator in evaluators.values():
                evaluator.close()
            if backend is not None:
                backend.close()
            daemon.stop()
    document["machine"] = {**machine, "load_average_at_end": load_average()}
    document["wall_s"] = round(time.perf_counter() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "decode.json", document)
    if plot:
        from evald_lab.bench._plots import plot_decode

        plot_decode(document, out_dir / "decode.png")
    return document
