"""When a jump batch takes a step: never two in a row from SGLang's own work (requests to admit,
a batch to decode), never one from a chunked prefill under way. The decision reads three things
of SGLang's scheduler (``waiting_queue``, ``chunked_req``, the running batch), so it is checked
here on stand-ins for them (named below); jumps themselves run in real servers
(``test_sglang_server.py``). No SGLang needed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_adapter.sglang._scheduling import SpanScheduler


@dataclass
class StandInScheduler:
    """Stands in for SGLang's ``Scheduler``: only the fields the decision reads."""

    waiting_queue: list[Any] = field(default_factory=list)
    chunked_req: Any = None
    result_queue: list[Any] = field(default_factory=list)


@dataclass
class StandInBatch:
    """Stands in for a ``ScheduleBatch``: only whether it is empty."""

    reqs: list[Any] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.reqs


@dataclass
class InFlight:
    """A parked request whose last step is still in flight: it cannot rejoin yet, so
    ``rejoin_batch`` returns before any SGLang object is needed."""

    rid: str = "r"


IN_FLIGHT = InFlight()


def parked_after_a_jump(state: SpanScheduler) -> None:
    """One parked request, and a jump built in the step just before this one."""
    state._parked[id(IN_FLIGHT)] = IN_FLIGHT
    state._jumped_at = state.stats.steps - 1


def scheduler(**fields: Any) -> StandInScheduler:
    """The stand-in scheduler, with the parked request's last step in flight."""
    return StandInScheduler(result_queue=[(StandInBatch(reqs=[IN_FLIGHT]), None)], **fields)


def test_a_jump_right_after_a_jump_yields_to_requests_waiting_for_admission() -> None:
    state = SpanScheduler()
    state.stats.steps = 10
    parked_after_a_jump(state)
    assert state.rejoin_batch(scheduler(waiting_queue=["new request"]), StandInBatch()) is None
    assert state.stats.yielded_steps == 1


def test_a_jump_right_after_a_jump_yields_to_the_running_batchs_decode() -> None:
    state = SpanScheduler()
    state.stats.steps = 10
    parked_after_a_jump(state)
    assert state.rejoin_batch(scheduler(), StandInBatch(reqs=["decoding"])) is None
    assert state.stats.yielded_steps == 1


def test_nothing_else_to_run_or_an_older_jump_does_not_yield() -> None:
    state = SpanScheduler()
    state.stats.steps = 10
    parked_after_a_jump(state)
    # Nobody else waits: the jump may take this step too (the request is in flight here, so
    # none is built, but nothing yielded).
    assert state.rejoin_batch(scheduler(), StandInBatch()) is None
    state._jumped_at = state.stats.steps - 2  # a decode or an admission ran in between
    assert state.rejoin_batch(scheduler(waiting_queue=["new"]), StandInBatch()) is None
    assert state.stats.yielded_steps == 0


def test_a_chunked_prefill_under_way_keeps_its_step() -> None:
    state = SpanScheduler()
    state._parked[id(IN_FLIGHT)] = IN_FLIGHT
    chunked = StandInScheduler(chunked_req="a long prompt, chunk 2 of 5")  # nothing in flight
    assert state.rejoin_batch(chunked, StandInBatch()) is None
    assert state.stats.yielded_steps == 0
