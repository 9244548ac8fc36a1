"""The adapter's state inside vLLM's scheduler: one injector per evaluated request.

Everything runs in the engine-core process, on the scheduler's thread, at these points of each
engine step (``EngineCore.step`` in ``vllm==0.32.0``):

1. :meth:`SpanTracker.before_schedule`, just before ``Scheduler.schedule()``. Each evaluated
   request's injector reads the tokens the last step appended to ``Request.output_token_ids``
   (sampled or forced); a span that closed is submitted without blocking, and every client with
   submissions is flushed once, so all spans that closed in one step travel to evald in one
   message. A request whose span value is pending and for which nothing can be forced yet is
   **held**: its ``next_decode_eligible_step`` is set past the coming step, so the scheduler
   leaves it out of that step while it keeps its KV blocks (the same path vLLM uses to stagger
   pipeline-parallel decodes); the model runner drops it from its persistent batch and takes it
   back, with its token history, when it is scheduled again. The rest of the batch runs on.
2. :meth:`SpanTracker.narrow_bitmask`, just after ``Scheduler.get_grammar_bitmask()`` (which runs
   while the forward pass is in flight). The row of each request with a token to force is
   narrowed to that one token, provided the grammar's own row allows it; the sampler can then
   only pick it (all other logits are ``-inf``), whatever the sampling settings. The grammar
   matcher accepts it like any sampled token, so a forced token is never one the grammar refuses.
3. :meth:`SpanTracker.finish`, when the scheduler frees a finished request: its injector is
   dropped and its spans are logged (``EVALD_SPAN_LOG``).

**With speculative decoding** (``max_drafts`` > 0: vLLM verifies draft tokens, see
``engine_adapter.vllm.proposer``), a request whose value is known gets the rest of its result
region as its draft tokens (``Request.spec_token_ids``, up to ``max_drafts``), and the bitmask
row of every draft position is narrowed to its draft, the row after them to the next forced
token: the verify step keeps every draft (greedy or not: the target distribution is that one
token), and the whole region enters the sequence in one forward. A request is then held until
its value is known instead of forcing the ``<result`` prefix first (the same latency: the
region's forward cannot start before the value is known; one forward fewer). Drafts from the
server's own proposer are cut before the token that would close a span
(:meth:`~engine_adapter.Injector.draft_limit`), so a span only ever closes on a step's last,
sampled token and the region after it is always forced, never verified from a draft.

Failures never abort a request: evald down, a timeout or an evaluator error become
``<result_error>CODE</result_error>`` in the text, and an internal fault (logged) only stops
evaluation for that request, which continues under its grammar alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapter.evaluation import SpanState, TokenCodec, open_span_state
from engine_adapter.serving import (
    AdapterConfig,
    AdapterRuntime,
    StepWaits,
    Tenancy,
    TenantRuntimes,
    allow_only,
    allows,
)
from engine_adapter.spans import ComputedPlan, EvalResult
from engine_adapter.vllm._computed_json import computed_plan
from engine_adapter.vllm._options import evaluated_spans

__all__ = ["SpanTracker", "TrackedRequest", "TrackerStats"]

logger = logging.getLogger("engine_adapter.vllm")

#: While every running request is held and nothing waits, the scheduler sleeps on the pending
#: evaluations in slices this long, so that new requests are still admitted promptly.
IDLE_WAIT_S = 0.02
#: vLLM samples greedily below this temperature (``vllm.sampling_params._SAMPLING_EPS``).
GREEDY_BELOW = 1e-5


@dataclass(eq=False)
class TrackedRequest:
    """One evaluated request: its injector and how far it has read the request's tokens."""

    request_id: str
    injector: SpanState
    output: Sequence[int]
    """The request's live ``output_token_ids``."""
    runtime: AdapterRuntime
    """Where its spans are evaluated (a refusing runtime answers every span with its code)."""
    fed: int = 0
    fault: str | None = None
    forced_steps: int = 0
    held_steps: int = 0
    held_until: int | None = None
    """The ``next_decode_eligible_step`` the request had before the adapter held it."""
    plan: tuple[int, ...] = ()
    """The tokens to force in the coming step: its drafts, then the token sampled after them."""


@dataclass
class TrackerStats:
    """Counters for logs, benchmarks and tests (approximate while the engine runs)."""

    requests: int = 0
    spans: int = 0
    forced_tokens: int = 0
    held_steps: int = 0
    idle_waits: int = 0
    fallback_waits: int = 0
    faults: int = 0
    draft_steps: int = 0
    """Steps in which a request's forced tokens went into the forward as verified drafts."""
    cut_drafts: int = 0
    """Proposer drafts cut before a token that would have closed a span."""


class SpanTracker:
    """Follows the evaluated requests of one scheduler.

    Parameters:
        config: the server's settings (``EVALD_*``).
        codec: the tokenizer's codec (the same vocabulary as the grammar's bitmask).
        max_drafts: vLLM's ``num_speculative_tokens`` when speculative decoding is on (forced
            tokens then go through the verify step as drafts, up to this many per forward),
            0 without it (one forced token per step).
        greedy_drafts_only: draft forced tokens only while every request on the server samples
            greedily (else one forced token per step): for a vLLM whose verify step mangles
            the sampling parameters of draft positions when a request samples randomly
            (``plugin.random_verify_is_broken``).
        runtime_factory: builds the server's own tenant's runtime (client, span log); the
            default shares one evald stream per process. Other tenants' runtimes come from
            :class:`~engine_adapter.serving.TenantRuntimes`.
    """

    def __init__(
        self,
        config: AdapterConfig,
        codec: TokenCodec,
        *,
        max_drafts: int = 0,
        greedy_drafts_only: bool = False,
        runtime_factory: Callable[[AdapterConfig], AdapterRuntime] | None = None,
    ) -> None:
        if max_drafts < 0:
            raise ValueError(f"max_drafts must not be negative, got {max_drafts}")
        self.config = config
        self.codec = codec
        self.max_drafts = max_drafts
        self.greedy_drafts_only = greedy_drafts_only
        self._sampling: set[str] = set()
        """Requests that sample randomly (followed only with ``greedy_drafts_only``)."""
        self.stats = TrackerStats()
        self.step_waits = StepWaits()
        """The budget of a row scheduled while its value is pending (a hold that could not
        apply): ``engine_adapter.serving._step_wait``."""
        # vLLM requests arrive with their spans lowered: no evaluator specs to refresh.
        self.tenants = TenantRuntimes(
            config, codec, refresh_s=None, runtime_factory=runtime_factory
        )
        self._states: dict[str, TrackedRequest] = {}
        self._pending: list[TrackedRequest] = []

    # ------------------------------------------------------------------ vLLM's calls

    def add(self, request: Any) -> TrackedRequest | None:
        """Starts following ``request`` if its structural tag holds evaluated spans, or if the
        API server lowered its JSON schema's computed properties
        (:mod:`engine_adapter.vllm._computed_json`): its state then follows the document."""
        if self.greedy_drafts_only and not _greedy(request):
            self._sampling.add(str(request.request_id))
        try:
            bindings = evaluated_spans(request.sampling_params)
            plan = computed_plan(request.sampling_params) if bindings is None else None
            if bindings is None and plan is None:
                return None
            extra = getattr(request.sampling_params, "extra_args", None)
            tenancy = self.tenants.for_request(extra, bindings or ())
            state = self._new_state(request, tenancy, plan)
        except Exception as exc:
            self.stats.faults += 1
            logger.error(
                "evald adapter: cannot follow request %s (%r); it runs under its grammar alone",
                getattr(request, "request_id", "?"),
                exc,
            )
            return None
        self._states[state.request_id] = state
        self.stats.requests += 1
        return state

    def before_schedule(self, scheduler: Any) -> None:
        """Reads the last step's tokens, submits closed spans, flushes, holds pending rows,
        plans what to force (as drafts with speculative decoding), cuts proposer drafts."""
        states = self._states
        self._pending = []
        self.step_waits.new_step()
        if not states:
            return
        requests = scheduler.requests
        pending = self._pending
        finished: list[str] = []
        cutting = self.max_drafts > 0
        drafting = cutting and not (self.greedy_drafts_only and self._sampling)
        for state in states.values():
            request = requests.get(state.request_id)
            if request is None or request.is_finished():
                finished.append(state.request_id)
                continue
            if state.fault is not None:
                continue
            state.plan = ()
            output = state.output
            count = len(output)
            injector = state.injector
            if count != state.fed:
                try:
                    if count < state.fed:
                        raise RuntimeError(f"{state.fed - count} output tokens disappeared")
                    for token in output[state.fed : count]:
                        injector.accept_token(token)
                except Exception as exc:
                    self._stop(state, f"accept_token failed: {exc!r}")
                    continue
                state.fed = count
            if state.held_until is not None or injector.pending:
                pending.append(state)
            elif cutting and request.spec_token_ids:
                self._cut_drafts(state, request)
        for request_id in finished:
            self._forget(request_id)
        if not pending:
            return
        self.flush()
        self._hold(scheduler, pending)
        manager = getattr(scheduler, "structured_output_manager", None)
        for state in pending:
            request = requests.get(state.request_id)
            if state.fault is not None or request is None:
                continue
            if state.held_until is None:
                self._plan(state, request, manager, self.max_drafts if drafting else 0)
            elif cutting:
                request.spec_token_ids = []  # no proposer draft enters a pending region

    def narrow_bitmask(self, grammar_output: Any, scheduler_output: Any = None) -> None:
        """Narrows the bitmask rows of requests with tokens to force to those tokens.

        A request's rows are consecutive: one per scheduled draft, then the one sampled after
        them (``vllm.v1.structured_output.utils.apply_grammar_bitmask``); ``scheduler_output``
        says how many drafts each request has (none without speculative decoding).
        """
        pending = self._pending
        if not pending or grammar_output is None:
            return
        bitmask = getattr(grammar_output, "grammar_bitmask", None)
        if bitmask is None:
            return
        ids = grammar_output.structured_output_request_ids
        spec: dict[str, Sequence[int]] = (
            getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        )
        rows = _row_starts(ids, spec) if spec or len(pending) > 4 else None
        for state in pending:
            if state.fault is not None:
                continue
            request_id = state.request_id
            start = rows.get(request_id) if rows is not None else _index(ids, request_id)
            if start is None:
                continue  # not scheduled this step (held, or its prefill is still running)
            try:
                scheduled = tuple(spec.get(request_id, ()))
                plan = state.plan
                if not plan and not scheduled:
                    token = self._next_forced(state)
                    plan = (token,) if token is not None else ()
                if scheduled != plan[: len(scheduled)]:
                    self._stop(state, f"drafts {list(scheduled)} are not the forced {list(plan)}")
                    continue
                forced = plan[: len(scheduled) + 1]
                for offset, token in enumerate(forced):
                    line = bitmask[start + offset]
                    if not allows(line, token):
                        self._stop(state, f"the grammar refuses forced token {token}")
                        break
                    allow_only(line, token)
                else:
                    if forced:
                        state.forced_steps += 1
                        self.stats.forced_tokens += len(forced)
                    if scheduled:
                        self.stats.draft_steps += 1
            except Exception as exc:
                self._stop(state, f"forcing failed: {exc!r}")

    def finish(self, request_id: str) -> None:
        """Forgets a finished request (``Scheduler._free_request``); logs its spans."""
        self._sampling.discard(request_id)
        self._forget(request_id)

    def close(self) -> None:
        """Forgets every request and closes the tenants' connections (the server's own shared
        client stays up for the process)."""
        for request_id in list(self._states):
            self._forget(request_id)
        self.tenants.close()

    @property
    def deadline_ms(self) -> int:
        """Per span (``EVALD_DEADLINE_MS``): the tracker is the scheduler's
        ``engine_adapter.evaluation.EngineRuntime``."""
        return self.config.deadline_ms

    def flush(self) -> None:
        """Sends the spans submitted this step, once per tenant runtime: a span that closed
        this step belongs to a pending request (called from ``before_schedule``)."""
        flushed: set[int] = set()
        for state in self._pending:
            runtime = state.runtime
            if id(runtime) not in flushed:
                flushed.add(id(runtime))
                runtime.flush()

    # ------------------------------------------------------------------ introspection

    @property
    def requests(self) -> dict[str, TrackedRequest]:
        return dict(self._states)

    # ------------------------------------------------------------------ internals

    def _new_state(
        self, request: Any, tenancy: Tenancy, plan: ComputedPlan | None = None
    ) -> TrackedRequest:
        runtime = tenancy.runtime
        injector = open_span_state(self, tenancy.bindings, runtime, auto_flush=False, computed=plan)
        return TrackedRequest(
            request_id=str(request.request_id),
            injector=injector,
            output=request.output_token_ids,
            runtime=runtime,
        )

    def _hold(self, scheduler: Any, pending: list[TrackedRequest]) -> None:
        step = int(scheduler.current_step) + 2  # schedule() increments it before comparing
        requests = scheduler.requests
        held: list[tuple[TrackedRequest, Any]] = []
        for state in pending:
            request = requests.get(state.request_id)
            if request is None:
                continue
            if self._must_wait(state):
                if state.held_until is None:
                    state.held_until = int(request.next_decode_eligible_step)
                request.next_decode_eligible_step = max(state.held_until, step)
                held.append((state, request))
            else:
                self._release(state, request)
        if held and len(held) >= len(scheduler.running) and not len(scheduler.waiting):
            # Nobody else could run this step: sleep on the evaluations instead of spinning.
            self.stats.idle_waits += 1
            futures = [f for s, _ in held for f in _futures(s)]
            if futures:
                concurrent.futures.wait(
                    futures, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
                )
            else:
                time.sleep(0.001)
            for state, request in held:
                if not self._must_wait(state):
                    self._release(state, request)
        for state, _ in held:
            if state.held_until is not None:
                state.held_steps += 1
                self.stats.held_steps += 1

    def _must_wait(self, state: TrackedRequest) -> bool:
        """Whether the request sits out the coming step: its value is pending and nothing can
        be forced; with drafts, until the value is known (the region then takes one forward)."""
        injector = state.injector
        try:
            if not injector.pending:
                return False
            if self.max_drafts:
                return not injector.result_known
            return not injector.forced_tokens()
        except Exception as exc:
            self._stop(state, f"forced_tokens failed: {exc!r}")
            return False

    def _plan(self, state: TrackedRequest, request: Any, manager: Any, max_drafts: int) -> None:
        """What the request forces in the coming step; with speculative decoding the region's
        tokens become its drafts, up to ``max_drafts`` (checked against the grammar, as vLLM
        checks a proposer's)."""
        injector = state.injector
        try:
            forced = injector.forced_tokens() if injector.pending else []
            if self.max_drafts:
                # A proposer's drafts never enter a result region: it is forced, or it waits.
                request.spec_token_ids = []
                drafts = forced[:max_drafts]
                if drafts and manager is not None:
                    valid = manager.validate_tokens(request, list(drafts))
                    if len(valid) < len(drafts):
                        self._stop(state, f"the grammar refuses forced token {drafts[len(valid)]}")
                        return
                request.spec_token_ids = list(drafts)
        except Exception as exc:
            self._stop(state, f"planning the forced tokens failed: {exc!r}")
            return
        state.plan = tuple(forced[: max_drafts + 1])

    def _cut_drafts(self, state: TrackedRequest, request: Any) -> None:
        """Cuts a proposer's drafts before the token that would close a span."""
        drafts = request.spec_token_ids
        try:
            keep = state.injector.draft_limit(drafts)
        except Exception as exc:
            request.spec_token_ids = []
            self._stop(state, f"draft_limit failed: {exc!r}")
            return
        if keep < len(drafts):
            request.spec_token_ids = list(drafts[:keep])
            self.stats.cut_drafts += 1

    @staticmethod
    def _release(state: TrackedRequest, request: Any) -> None:
        if state.held_until is not None:
            request.next_decode_eligible_step = state.held_until
            state.held_until = None

    def _next_forced(self, state: TrackedRequest) -> int | None:
        injector = state.injector
        if not injector.pending:
            return None
        forced = injector.forced_tokens()
        if not forced:
            # Scheduled although its value is pending (a hold that could not apply): the row
            # must not sample inside the result region, and the rest of the batch must not
            # wait for it: the step's small budget, then the span ends in band.
            self.stats.fallback_waits += 1
            self.step_waits.settle(injector)
            forced = injector.forced_tokens()
        return forced[0] if forced else None

    def _forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            return
        spans = state.injector.spans
        self.stats.spans += len(spans)
        runtime = state.runtime
        config = getattr(runtime, "config", None)
        if config is not None and config.span_log is not None:
            for record in spans:
                if record.result is not None:
                    runtime.log_span(record)

    def _stop(self, state: TrackedRequest, reason: str) -> None:
        state.fault = reason
        state.held_until = None
        self.stats.faults += 1
        logger.error(
            "evald adapter: stopped evaluating spans for request %s (%s); it continues under "
            "its grammar alone",
            state.request_id,
            reason,
        )


def _greedy(request: Any) -> bool:
    """Whether vLLM samples the request greedily (``SamplingParams.sampling_type``)."""
    params = getattr(request, "sampling_params", None)
    temperature = getattr(params, "temperature", None)
    return params is None or (temperature is not None and temperature < GREEDY_BELOW)


def _row_starts(ids: Sequence[str], spec: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """The first bitmask row of each request: one row per scheduled draft, plus one."""
    starts: dict[str, int] = {}
    row = 0
    for request_id in ids:
        starts[request_id] = row
        row += 1 + len(spec.get(request_id, ()))
    return starts


def _index(ids: Sequence[str], request_id: str) -> int | None:
    try:
        return ids.index(request_id)
    except ValueError:
        return None


def _futures(state: TrackedRequest) -> Iterable[concurrent.futures.Future[EvalResult]]:
    spans = state.injector.spans
    if spans and spans[-1].future is not None and spans[-1].result is None:
        yield spans[-1].future
