"""The adapter inside SGLang's scheduler: a request whose span is being evaluated sits out decode
steps, keeping its KV cache, and comes back with the whole result region in one forward.

SGLang's scheduler (``sglang==0.5.23``, ``Scheduler.event_loop_normal`` / ``event_loop_overlap``)
builds each step in ``get_next_batch_to_run``: it merges the last prefill into the running batch,
asks ``get_new_batch_prefill`` for an extend batch (which runs first), and otherwise prepares the
running batch for one decode step. :class:`SpanScheduler` hooks two of those calls:

- **Sit out** (start of ``get_next_batch_to_run``): every request of the running batch whose
  grammar object reports a closed span without its result region in the sequence
  (:attr:`EvaluatorGrammar.wants_out`) is filtered out of the batch with
  ``ScheduleBatch.filter_batch``, exactly as SGLang drops a finished request. It keeps its
  ``req_to_token`` row and its KV (nothing is freed, nothing is retracted), so the rest of the
  batch decodes without it and no step waits for an evaluator.
- **Jump forward** (``get_new_batch_prefill``): a parked request whose region is known (the value
  came back, an error, or the span deadline passed) takes the region's tokens into its output
  (each accepted by the grammar, as if sampled) and rejoins as an **extend** whose prefix is its
  own KV row (``req.prefix_len`` = its committed KV, as for the next chunk of a chunked prefill):
  the span's closing token and the whole region, ``</calc><result>482</result>``, go through the
  model in one forward, whose last position samples the first free token. SGLang then merges it
  into the running batch like any prefill. With ``--enable-mixed-chunk`` the running batch's
  decode rides along in the same forward (``ScheduleBatch.mix_with_running``).

With the overlap scheduler (SGLang's default on GPUs) the next step is launched before the last
one's tokens are processed. A request is only ever taken out or brought back when none of its
results is in flight (``Scheduler.result_queue``); the step that was already launched when its
span closed forces the region's first token (the shared ``<result`` prefix) through the grammar
mask, and the request sits out from the step after. When nothing of the region can be forced in
that step (result and error openers with no shared first character), the row waits at most the
step's small budget and its span then ends in band (``engine_adapter.serving._step_wait``):
the step is every tenant's.

Three more hooks keep SGLang's bookkeeping whole while a request is parked: ``is_fully_idle``
(not idle: its idle-time KV leak check would count the parked rows as leaked),
``collect_inflight_reqs`` (aborts and weight-version events reach parked requests; an aborted
one rejoins at once and finishes through SGLang's own path) and the idle wait (when nothing else
can run, the scheduler sleeps on the pending evaluations instead of spinning).

Everything here runs on the scheduler thread. A failure in a hook is logged and leaves SGLang's
own step as it would have been: a parked request rejoins (its region then forced one token per
step), never lost.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_adapter.serving import StepWaits
from engine_adapter.sglang._rank_sync import rank_sync

if TYPE_CHECKING:
    from engine_adapter.sglang._grammar_object import EvaluatorGrammar

__all__ = [
    "COST_LOG_STEPS",
    "IDLE_WAIT_S",
    "SchedulerStats",
    "SpanScheduler",
    "scheduler_state",
]

logger = logging.getLogger("engine_adapter.sglang")

#: While every request is parked and nothing else can run, the scheduler sleeps on the pending
#: evaluations in slices this long, so that new requests are still admitted promptly.
IDLE_WAIT_S = 0.005

_STATE_ATTR = "_evald_span_scheduler"


@dataclass
class SchedulerStats:
    """Counters for logs, benchmarks and tests (one scheduler process)."""

    parked: int = 0
    """Requests taken out of the decode batch while a span's value was pending."""
    jumps: int = 0
    """Extend forwards that brought parked requests back (one per batch of requests)."""
    jumped_requests: int = 0
    forced_tokens: int = 0
    """Region tokens that went into sequences through jumps."""
    idle_waits: int = 0
    yielded_steps: int = 0
    """Steps a ready jump left to SGLang's own work because the step before was a jump."""
    faults: int = 0
    steps: int = 0
    """Steps the hooks ran in (``get_next_batch_to_run`` calls)."""
    hook_ns: int = 0
    """Time spent in the adapter's scheduler hooks, sleeps on evaluations excluded."""


#: Every this many steps the scheduler logs what its hooks cost per step (the server's own
#: measure of the adapter's overhead on requests without spans).
COST_LOG_STEPS = 256


def scheduler_state(scheduler: Any) -> SpanScheduler:
    """The :class:`SpanScheduler` of one SGLang ``Scheduler`` (made on first use)."""
    state: SpanScheduler | None = getattr(scheduler, _STATE_ATTR, None)
    if state is None:
        state = SpanScheduler()
        setattr(scheduler, _STATE_ATTR, state)
    return state


class SpanScheduler:
    """The parked requests of one scheduler and the jump batches that bring them back."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()
        self.step_waits = StepWaits()
        """The budget of the rare row that must wait for a value in a step already built
        when its span closed (the overlap scheduler): ``engine_adapter.serving._step_wait``."""
        self._parked: dict[int, Any] = {}  # id(req) -> req, in the order they left
        self._jumped_at = -2
        """``stats.steps`` when the last jump batch was built."""
        self.sync = rank_sync()
        """With tensor parallelism, the exchange that gives every rank the same span outcomes
        and checks that they decide alike (``engine_adapter.sglang._rank_sync``)."""

    def exchange(self) -> None:
        """With tensor parallelism, publishes the span outcomes on every rank at the start of
        a step (first thing in ``get_next_batch_to_run``) whenever evaluations are in play:
        spans not yet published, requests sitting out, or a jump in the step before (its
        decisions are checked). These follow from the batches, the same on every rank.

        Raises:
            RankDivergence: the ranks decided differently (the scheduler must stop).
        """
        sync = self.sync
        if sync is None:
            return
        if sync.has_open or self._parked or self._jumped_at == self.stats.steps - 1:
            sync.exchange()

    # ------------------------------------------------------------------ SGLang's calls

    def count_step(self, elapsed_ns: int) -> None:
        """Adds one step's hook time; logs the average every :data:`COST_LOG_STEPS` steps."""
        stats = self.stats
        stats.steps += 1
        stats.hook_ns += elapsed_ns
        if stats.steps % COST_LOG_STEPS == 0:
            waits = self.step_waits
            logger.info(
                "evald adapter: scheduler hooks %.1f us per step (%d steps; %d rows waited "
                "for a value within a step's budget, %d spans ended in band past it, %d jumps "
                "yielded a step)",
                stats.hook_ns / stats.steps / 1000.0,
                stats.steps,
                waits.waits,
                waits.gave_up,
                stats.yielded_steps,
            )

    @property
    def parked(self) -> list[Any]:
        """The requests sitting out, oldest first."""
        return list(self._parked.values())

    def sit_out(self, scheduler: Any, running_batch: Any) -> None:
        """Flushes the evaluations submitted since the last step and takes the requests that
        wait for a span's value out of ``running_batch`` (before the step is built)."""
        self.step_waits.new_step()
        grammar_type = _grammar_type()
        leaving = []
        flushed: set[int] = set()
        for req in (*running_batch.reqs, *self._parked.values()):
            grammar = req.grammar
            if not isinstance(grammar, grammar_type):
                continue
            if grammar.step_waits is None:
                grammar.step_waits = self.step_waits
            runtime = grammar.runtime
            if id(runtime) not in flushed:
                flushed.add(id(runtime))
                runtime.flush()
            if (
                grammar.wants_out
                and id(req) not in self._parked
                and req.to_finish is None
                and not req.finished()
            ):
                leaving.append(req)
        if not leaving:
            return
        running_batch.filter_batch(reqs_to_exclude=leaving)
        running_batch.batch_is_full = False
        for req in leaving:
            self._parked[id(req)] = req
        self.stats.parked += len(leaving)
        if self.sync is not None:
            self.sync.note("out", self.stats.steps, *(req.rid for req in leaving))

    def rejoin_batch(self, scheduler: Any, running_batch: Any) -> tuple[Any, Any] | None:
        """``(extend batch, running batch)`` for the parked requests that can come back now,
        or ``None``.

        A request comes back when its region is known and none of its results is in flight,
        or when it was aborted (it then finishes through SGLang's own path). With
        ``--enable-mixed-chunk`` the running batch's decode step joins the extend and the
        returned running batch is empty, as after SGLang's own mixed prefill.

        A jump never takes two steps in a row from SGLang's own work (new requests to admit, a
        running batch to decode), and never a step from a chunked prefill under way: values
        that come back one after another, many tenants' at once, must not keep other requests
        from their first token or their next one. What waits is one step for the next jump.
        """
        if not self._parked:
            return None
        if getattr(scheduler, "chunked_req", None) is not None:
            return None  # its next chunk is SGLang's step (it keeps its state across them)
        if self._jumped_at == self.stats.steps - 1 and _own_work(scheduler, running_batch):
            self.stats.yielded_steps += 1
            return None
        in_flight = _in_flight(scheduler)
        grammar_type = _grammar_type()
        jumped = []
        for key, req in list(self._parked.items()):
            if id(req) in in_flight:
                continue
            grammar = req.grammar
            aborted = req.to_finish is not None or req.finished()
            if not (aborted or not isinstance(grammar, grammar_type) or grammar.ready_to_rejoin):
                continue
            if req.finished():  # never run a finished request again (not seen in 0.5.23)
                del self._parked[key]
                continue
            if not self._take_region(scheduler, req):
                continue  # no KV room for the region yet: try again next step
            del self._parked[key]
            jumped.append(req)
            if self.sync is not None:
                tail = req.output_ids[-8:]
                self.sync.note("back", self.stats.steps, req.rid, len(req.output_ids), *tail)
        if not jumped:
            return None
        batch = _extend_batch(scheduler, jumped)
        _count_as_prefill(scheduler, batch, running_batch)
        self._jumped_at = self.stats.steps
        self.stats.jumps += 1
        self.stats.jumped_requests += len(jumped)
        # SGLang logs the jump as a ``Prefill batch`` (its statistics are a prefill's): say
        # which one it is, or a jump of parked requests reads as new requests admitted late.
        logger.info(
            "evald adapter: jump batch, %d parked request(s) back with %d token(s) "
            "(span close and result region), %d still parked",
            len(jumped),
            sum(batch.extend_lens),
            len(self._parked),
        )
        if getattr(scheduler, "is_mixed_chunk", False) and _mix(batch, running_batch):
            from sglang.srt.managers.schedule_batch import ScheduleBatch

            running_batch = ScheduleBatch(reqs=[], batch_is_full=running_batch.batch_is_full)
        return batch, running_batch

    def wait_if_idle(self, scheduler: Any, running_batch: Any) -> None:
        """Sleeps on the pending evaluations (at most :data:`IDLE_WAIT_S`) when every request
        is parked and nothing else waits: the scheduler would otherwise spin, taking the CPU
        that the evaluations need on a small machine."""
        if not self._parked or not running_batch.is_empty():
            return
        if len(getattr(scheduler, "waiting_queue", ())):
            return
        if self.sync is not None:  # the leader sleeps on evald; the others on its broadcast
            futures = list(self.sync.idle_futures())
        else:
            futures = [f for f in _pending_futures(self._parked.values()) if f is not None]
        self.stats.idle_waits += 1
        if futures:
            concurrent.futures.wait(
                futures, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
            )

    # ------------------------------------------------------------------ internals

    def _take_region(self, scheduler: Any, req: Any) -> bool:
        """Puts the rest of the region into ``req``'s output and sets it up as an
        extend of everything its KV row lacks; ``False`` when it must wait for KV room."""
        committed = int(req.kv.kv_committed_len)
        if req.seqlen != committed + 1:  # the decode-step invariant: KV holds all but the last
            self.stats.faults += 1
            logger.error(
                "evald adapter: request %s sat out with %d tokens and %d in its KV row; "
                "it rejoins with the missing ones",
                req.rid,
                req.seqlen,
                committed,
            )
        tokens: list[int] = []
        grammar = req.grammar
        if req.to_finish is not None:
            # Aborted while it sat out: one forward finishes it through SGLang's own path; its
            # grammar goes, as in SGLang's own aborts (its sampled token is thrown away), so
            # that sampling never waits for the span it no longer needs.
            req.grammar = grammar = None
        room = int(req.sampling_params.max_new_tokens) - len(req.output_ids) - 1
        # With logprobs asked for, each forced token must be sampled in a decode step of its
        # own to get its output logprob: the request rejoins and its region (known by now, so
        # nothing waits) is forced one token per step.
        jumping = isinstance(grammar, _grammar_type()) and not req.return_logprob
        if not _kv_room(scheduler, req.seqlen - committed + (max(room, 0) if jumping else 0)):
            return False
        if jumping:
            tokens = grammar.take_region(room)
        req.output_ids.extend(tokens)
        self.stats.forced_tokens += len(tokens)
        req.refresh_fill_ids()
        req.prefix_len = committed
        req.extend_end = req.seqlen
        # Tokens the request computed itself are not prefix-cache hits.
        req.already_computed = committed
        return True


def _grammar_type() -> type[EvaluatorGrammar]:
    from engine_adapter.sglang._grammar_object import EvaluatorGrammar

    return EvaluatorGrammar


def _in_flight(scheduler: Any) -> set[int]:
    """``id`` of every request with a launched step whose result is not processed yet."""
    queue: Iterable[tuple[Any, Any]] = getattr(scheduler, "result_queue", None) or ()
    return {id(req) for batch, _ in queue for req in batch.reqs}


def _own_work(scheduler: Any, running_batch: Any) -> bool:
    """Whether SGLang has a step of its own to run: requests to admit or a batch to decode."""
    return bool(len(getattr(scheduler, "waiting_queue", ()))) or not running_batch.is_empty()


def _pending_futures(reqs: Iterable[Any]) -> Iterable[Any]:
    for req in reqs:
        grammar = req.grammar
        pending_future: Callable[[], Any] | None = getattr(grammar, "pending_future", None)
        if pending_future is not None:
            yield pending_future()


def _kv_room(scheduler: Any, tokens: int) -> bool:
    """Whether the KV pool can take ``tokens`` more (after evicting from the prefix cache)."""
    allocator = scheduler.token_to_kv_pool_allocator
    if allocator.available_size() >= tokens:
        return True
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    evict_from_tree_cache(scheduler.tree_cache, tokens)
    return bool(allocator.available_size() >= tokens)


def _extend_batch(scheduler: Any, reqs: list[Any]) -> Any:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    batch = ScheduleBatch.init_new(
        reqs,
        scheduler.req_to_token_pool,
        scheduler.token_to_kv_pool_allocator,
        scheduler.tree_cache,
        scheduler.model_config,
        scheduler.enable_overlap,
        scheduler.spec_algorithm,
    )
    batch.contains_last_prefill_chunk = True
    batch.hisparse_coordinator = getattr(scheduler, "hisparse_coordinator", None)
    batch.prepare_for_extend()
    batch.decoding_reqs = None
    return batch


def _count_as_prefill(scheduler: Any, batch: Any, running_batch: Any) -> None:
    """Gives the jump batch SGLang's prefill statistics, so the server logs it as a
    ``Prefill batch`` and counts its forward in ``sglang:cuda_graph_passes_total`` like any
    other extend (optional: a batch without them runs the same)."""
    try:
        from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats
        from sglang.srt.observability.metrics_collector import QueueCount

        batch.prefill_stats = PrefillStats(
            log_input_tokens=sum(batch.extend_lens),
            log_hit_tokens=0,
            new_token_ratio=float(scheduler.new_token_ratio_tracker.current),
            num_running_reqs=QueueCount.from_reqs(running_batch.reqs),
            num_new_seqs=len(batch.reqs),
        )
    except Exception as exc:  # statistics only
        logger.debug("evald adapter: no prefill statistics for a jump batch (%r)", exc)


def _mix(batch: Any, running_batch: Any) -> bool:
    """Runs the running batch's decode step in the jump's forward (``--enable-mixed-chunk``),
    as SGLang's own mixed chunked prefill does; whether it did."""
    if running_batch.is_empty() or batch.return_logprob or running_batch.return_logprob:
        return False
    if not running_batch.check_decode_mem():
        return False
    running_batch.prepare_for_decode()
    batch.mix_with_running(running_batch)
    batch.decoding_reqs = running_batch.reqs
    return True
