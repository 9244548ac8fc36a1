"""One decision for every tensor-parallel rank: spans evaluated once, outcomes seen by all.

With ``--tp-size`` N, SGLang runs N scheduler processes, one per rank. Each receives the same
requests (rank 0 broadcasts them), runs the same grammar objects and samples the same tokens
(SGLang all-reduces the sampled ids whenever a batch has grammars), and each builds the same
batches: the ranks' forwards are collective operations, so a batch that differs on one rank
hangs them all. What the adapter adds is the one input that is not the same on every rank by
construction: *when* a span's value is known. Asked separately, N clients would get their
answers at N different moments, and each rank's clock would end a late span at its own instant;
a request that rejoins on one rank and still sits out on another splits the batch.

So the leader (the first rank of SGLang's ``dp_tp_group``, the group SGLang's own grammar manager
synchronises over) is the only rank that sends spans to evald. Every rank records the same
spans in the same order (the same tokens close them), and at the start of every step that has
evaluations in play — the same steps on every rank, since they follow from the same batches —
:meth:`RankSync.exchange` broadcasts from the leader, over SGLang's CPU process group
(``torch.distributed.broadcast_object_list``, as SGLang broadcasts multimodal inputs):

- the outcomes that came back since the last exchange, and the spans the leader's clock ended
  with ``deadline_exceeded``: every rank completes the same span futures at the same point of
  the same step, so every sit-out, jump and error region is decided identically (span states
  never end a span by their own clock: :attr:`RankEvaluator.decides_deadlines`);
- a digest of every decision the leader's scheduler made since the start (requests that sat
  out, regions forced with their tokens, spans ended within a step's budget) and a check of each
  span's evaluator and input. A rank whose decisions differ raises :class:`RankDivergence`,
  which stops its scheduler with the step and the digests: a bug found and named, not a hang.

The step budget of the overlap scheduler (``engine_adapter.serving._step_wait``) works as with
one rank: the leader waits for the value within the budget, then every rank takes part in one
exchange at that row (:meth:`RankSync.settle`) and all force the value or end the span alike.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.evaluation import SpanState
from engine_adapter.serving import StepWaits
from engine_adapter.spans import EvalResult, SpanEvaluator
from evald.contract import ErrorCode

__all__ = [
    "RankDivergence",
    "RankEvaluator",
    "RankSync",
    "RankSyncStats",
    "agree_on_compiles",
    "queue_cache_hits",
    "rank_sync",
    "torch_collectives",
]

logger = logging.getLogger("engine_adapter.sglang")

Broadcast = Callable[[Any], Any]
"""Sends the leader's object to every rank of the group; returns what the leader sent."""
Gather = Callable[[Any], list[Any]]
"""Every rank's object, in rank order, on every rank."""


class RankDivergence(RuntimeError):
    """The ranks of one tensor-parallel group decided differently: an adapter bug. Raised so
    that the scheduler stops with the evidence instead of hanging in its next collective."""


@dataclass
class RankSyncStats:
    """Counters for logs and tests (one scheduler process)."""

    exchanges: int = 0
    """Broadcasts this rank took part in."""
    published: int = 0
    """Span outcomes made visible to the scheduler (on every rank alike)."""
    deadlines: int = 0
    """Spans the leader's clock ended with ``deadline_exceeded`` (counted on rank 0, which
    decides them)."""
    settles: int = 0
    """Exchanges at a row that had to wait within a step's budget."""


@dataclass
class _Span:
    published: concurrent.futures.Future[EvalResult]
    check: int
    deadline_ms: int
    real: concurrent.futures.Future[EvalResult] | None = None
    deadline_at: float = 0.0
    result: EvalResult | None = field(default=None, repr=False)


class RankEvaluator:
    """A tenant's evaluator as the span states of one rank see it: spans go to evald from the
    leader only, and their futures complete at exchanges, with the deadline error included."""

    decides_deadlines = True

    def __init__(self, sync: RankSync, inner: SpanEvaluator) -> None:
        self._sync = sync
        self._inner = inner

    def submit(
        self, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        return self._sync.submit(self._inner, evaluator, content, deadline_ms)

    def flush(self) -> None:
        if self._sync.is_leader:
            self._inner.flush()


class RankSync:
    """The span outcomes and decisions of one rank, exchanged with the group's leader.

    Parameters:
        rank: this rank's index in the group (0 is the leader).
        world_size: ranks in the group (more than one).
        broadcast: the group's broadcast from the leader (:func:`torch_collectives`).
        gather: the group's gather of every rank's object.
        clock: the leader's clock for span deadlines.

    Thread-safety: driven by the scheduler thread (submissions, exchanges); the evaluations
    complete on other threads and are only read here.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        broadcast: Broadcast,
        gather: Gather,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of {world_size}: a group of two or more ranks")
        self.rank = rank
        self.world_size = world_size
        self._broadcast = broadcast
        self._gather = gather
        self._clock = clock
        self._seq = 0
        self._open: dict[int, _Span] = {}
        self._digest = 0
        self._evaluators: dict[int, RankEvaluator] = {}
        self.stats = RankSyncStats()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def has_open(self) -> bool:
        """Spans submitted whose outcome is not published yet (the same on every rank)."""
        return bool(self._open)

    @property
    def digest(self) -> int:
        return self._digest

    def evaluator(self, inner: SpanEvaluator) -> RankEvaluator:
        """The rank's view of ``inner`` (one per tenant runtime)."""
        wrapper = self._evaluators.get(id(inner))
        if wrapper is None:
            wrapper = self._evaluators[id(inner)] = RankEvaluator(self, inner)
        return wrapper

    def submit(
        self, inner: SpanEvaluator, evaluator: str, content: str, deadline_ms: int
    ) -> concurrent.futures.Future[EvalResult]:
        """Records a span (every rank, in the same order); the leader also sends it to evald.
        The returned future completes at the exchange that publishes its outcome."""
        published: concurrent.futures.Future[EvalResult] = concurrent.futures.Future()
        span = _Span(published, _check(evaluator, content), deadline_ms)
        if self.is_leader:
            span.deadline_at = self._clock() + deadline_ms / 1000.0
            try:
                span.real = inner.submit(evaluator, content, deadline_ms)
            except Exception as exc:  # a client must not raise; if it does, the span still ends
                span.result = EvalResult(None, ErrorCode.INTERNAL, f"submit failed: {exc}")
        self._open[self._seq] = span
        self._seq += 1
        return published

    def note(self, *decision: object) -> None:
        """Adds one scheduler decision to this rank's digest (compared at each exchange)."""
        self._digest = zlib.crc32(repr(decision).encode(), self._digest)

    def exchange(self) -> None:
        """Publishes, on every rank at once, the outcomes the leader has now (every rank calls
        it at the same point of the same step).

        Raises:
            RankDivergence: this rank's spans or decisions differ from the leader's.
        """
        self.stats.exchanges += 1
        if self.is_leader:
            message = (self._seq, self._digest, self._ready())
            self._broadcast(message)
        else:
            message = self._broadcast(None)
        seq, digest, outcomes = message
        if seq != self._seq or digest != self._digest:
            raise RankDivergence(
                f"evald adapter: tensor-parallel rank {self.rank} diverged from rank 0 at "
                f"exchange {self.stats.exchanges}: {self._seq} spans and decision digest "
                f"{self._digest:08x} here, {seq} and {digest:08x} on rank 0"
            )
        for index, check, result in outcomes:
            span = self._open.pop(index, None)
            if span is None or span.check != check:
                raise RankDivergence(
                    f"evald adapter: tensor-parallel rank {self.rank} diverged from rank 0 at "
                    f"exchange {self.stats.exchanges}: span {index} "
                    + ("is not open here" if span is None else "has another evaluator or input")
                )
            span.published.set_result(result)
            self.stats.published += 1

    def settle(self, state: SpanState, waits: StepWaits, published: Any) -> bool:
        """A row in a step already built when its span closed, with nothing of its region to
        force yet (the overlap scheduler): the leader waits for the value within the step's
        budget, then one exchange publishes it (or not) everywhere, and every rank forces it or
        ends the span in band alike. Returns whether there is something to force."""
        if not state.pending:
            return False
        if state.forced_tokens():
            return True
        left = waits.take_wait()
        if self.is_leader and left > 0:
            real = self._real(published)
            if real is not None:
                concurrent.futures.wait([real], timeout=left)
        self.stats.settles += 1
        self.exchange()
        known = state.result_known
        self.note("settle", state.span_count, known)
        return bool(state.forced_tokens()) if known else waits.end_in_band(state)

    def agree_on_refusals(self, reqs: list[Any], refuse: Callable[[Any, str], None]) -> None:
        """After SGLang's grammar manager hands out compiled requests (the same ones on every
        rank): a request refused on any rank is refused on all, with that rank's message.

        A compile that reads evald (the tenant's evaluators) could succeed on one rank and
        fail on another (evald restarted, an evaluator registered in between), or lower the
        request from two revisions of its evaluators into two grammars; the request would then
        run on some ranks only, or under masks that differ. Either way it is refused on every
        rank. ``refuse(req, message)`` refuses it here.
        """
        if not reqs:  # the same on every rank: SGLang synchronised which are ready
            return
        mine = [(getattr(req, "rid", None), _refusal(req), _grammar_digest(req)) for req in reqs]
        everyone = self._gather(mine)
        if any(len(ranks) != len(reqs) for ranks in everyone) or any(
            ranks[i][0] != mine[i][0] for ranks in everyone for i in range(len(reqs))
        ):
            raise RankDivergence(
                f"evald adapter: tensor-parallel rank {self.rank} holds other compiled "
                f"requests than its peers: {[m[0] for m in mine]} here, "
                f"{[[m[0] for m in ranks] for ranks in everyone]}"
            )
        for index, req in enumerate(reqs):
            views = [ranks[index] for ranks in everyone]
            if mine[index][1] is not None:
                continue
            refusals = [message for _, message, _ in views if message is not None]
            if refusals:
                refuse(req, refusals[0])
            elif len({digest for _, _, digest in views}) > 1:
                refuse(req, _CHANGED_MEANWHILE)

    def idle_futures(self) -> list[concurrent.futures.Future[EvalResult]]:
        """What the leader's idle scheduler may sleep on (the evaluations in flight); nothing on
        the other ranks, which wait for the leader's next broadcast instead."""
        if not self.is_leader:
            return []
        return [s.real for s in self._open.values() if s.real is not None and not s.real.done()]

    # ------------------------------------------------------------------ internals

    def _ready(self) -> list[tuple[int, int, EvalResult]]:
        """The leader's outcomes to publish now, in submission order."""
        now = self._clock()
        ready = []
        for index, span in self._open.items():
            result = span.result
            if result is None and span.real is not None and span.real.done():
                result = _outcome(span.real)
            if result is None and now >= span.deadline_at:
                self.stats.deadlines += 1
                result = EvalResult(
                    None,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"no value within the deadline of {span.deadline_ms} ms",
                )
            if result is not None:
                ready.append((index, span.check, result))
        return ready

    def _real(self, published: Any) -> concurrent.futures.Future[EvalResult] | None:
        for span in self._open.values():
            if span.published is published:
                return span.real
        return None


_CHANGED_MEANWHILE = (
    "evald adapter: the tenant's evaluators changed while this request's grammar was made (the "
    "tensor-parallel ranks lowered it from different revisions); send it again"
)


def _grammar_digest(req: Any) -> int | None:
    """What an evaluated request's grammar was lowered to (the same text on every rank unless
    the tenant's evaluators changed between the ranks' compiles); None for any other."""
    key = getattr(getattr(req, "grammar", None), "evald_lowered_key", None)
    return zlib.crc32(key.encode()) if isinstance(key, str) else None


def _refusal(req: Any) -> str | None:
    """The abort message of a request SGLang refused (``FINISH_ABORT``), else ``None``."""
    finish = getattr(req, "to_finish", None)
    if finish is None or type(finish).__name__ != "FINISH_ABORT":
        return None
    return str(getattr(finish, "message", "Aborted"))


def _check(evaluator: str, content: str) -> int:
    return zlib.crc32(f"{evaluator}\0{content}".encode())


def _outcome(future: concurrent.futures.Future[EvalResult]) -> EvalResult:
    try:
        return future.result()
    except Exception as exc:
        return EvalResult(None, ErrorCode.INTERNAL, f"evaluator failed: {exc}")


def agree_on_compiles(manager: Any, reqs: list[Any]) -> None:
    """After SGLang's grammar manager hands out ``reqs`` (the same on every rank): with tensor
    parallelism, refusals and grammars are agreed (:meth:`RankSync.agree_on_refusals`); a
    request refused here is refused as the rank that refused it did: an invalid grammar, cached
    under its key so a later request with it is refused at once on this rank too, and the
    abort."""
    sync = rank_sync()
    if sync is None:
        return

    def refuse(req: Any, message: str) -> None:
        from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

        invalid = InvalidGrammarObject(message)
        key = getattr(req, "grammar_key", None)
        if key is not None:
            manager.grammar_backend.set_cache(key, invalid)
        req.grammar = invalid
        req.set_finish_with_abort(message)

    sync.agree_on_refusals(reqs, refuse)


def queue_cache_hits(backend: Any) -> None:
    """Makes SGLang's grammar cache answer a hit as a compile that is already done.

    A request's cache key holds its tenant's spec revision, which each rank learns from evald
    on its own: for a while one rank may hit the cache where another misses. A hit goes
    straight to the waiting queue and a miss through the grammar queue, so the two ranks would
    admit the request at different steps. As a done future, a hit takes the grammar queue too,
    where SGLang's grammar manager admits a request on every rank at once (the copy still
    saves the compile).
    """
    cached = backend.get_cached_or_future_value

    def get_cached_or_future_value(key: Any, require_reasoning: bool) -> tuple[Any, bool]:
        value, hit = cached(key, require_reasoning)
        if not hit:
            return value, False
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.set_result(value)
        return done, False

    backend.get_cached_or_future_value = get_cached_or_future_value


def torch_collectives(group: Any) -> tuple[Broadcast, Gather]:
    """The broadcast (from its first rank) and the gather over one of SGLang's
    ``GroupCoordinator`` CPU groups, as SGLang's scheduler and grammar manager use them.

    The broadcast carries :meth:`RankSync.exchange`'s message ``(spans, digest, outcomes)``:
    one collective of three integers when there is no outcome to publish (most steps), a second
    with the pickled outcomes when there are (``broadcast_object_list`` always takes two)."""
    import pickle

    import torch
    import torch.distributed as dist

    def broadcast(message: Any) -> Any:
        header = torch.zeros(3, dtype=torch.int64)
        payload = b""
        if message is not None:
            spans, digest, outcomes = message
            payload = pickle.dumps(outcomes) if outcomes else b""
            header[0], header[1], header[2] = spans, digest, len(payload)
        dist.broadcast(header, src=group.first_rank, group=group.cpu_group)
        if message is not None:
            if payload:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, src=group.first_rank, group=group.cpu_group)
            return message
        spans, digest, size = (int(v) for v in header.tolist())
        if not size:
            return spans, digest, []
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, src=group.first_rank, group=group.cpu_group)
        return spans, digest, pickle.loads(data.numpy().tobytes())

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * int(group.world_size)
        dist.all_gather_object(out, obj, group=group.cpu_group)
        return out

    return broadcast, gather


_SYNC: RankSync | None = None
_RESOLVED = False
_LOCK = threading.Lock()


def rank_sync() -> RankSync | None:
    """This scheduler process's :class:`RankSync`, or ``None`` with one rank per group (or
    outside a scheduler process). Resolved once, from SGLang's ``dp_tp_group``: the ranks that
    run one batch together (the whole TP group, or the attention-TP group with DP attention)."""
    global _SYNC, _RESOLVED
    with _LOCK:
        if not _RESOLVED:
            _SYNC = _resolve()
            _RESOLVED = True
        return _SYNC


def _resolve() -> RankSync | None:
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group

        group = get_dp_tp_group()
        world = int(group.world_size)
        rank = int(group.rank_in_group)
    except Exception:  # no distributed state in this process: one rank
        return None
    if world < 2:
        return None
    logger.info(
        "evald adapter: tensor-parallel rank %d of %d: spans are evaluated by rank 0 and "
        "their outcomes exchanged at each step",
        rank,
        world,
    )
    return RankSync(rank, world, *torch_collectives(group))
