"""The rank exchange (``engine_adapter.sglang._rank_sync``) between two real processes over a
real ``torch.distributed`` gloo group, as SGLang's scheduler ranks use it: spans are evaluated
by rank 0 only (the real WASM host), every rank sees each outcome at the same exchange, a late
span ends by rank 0's clock on both, and a rank whose decisions differ is stopped with the
evidence instead of hanging.

The real servers (``--tp-size 2``) are in test_sglang_tensor_parallel.py.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter.testing._common import free_port

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]


class NeverCalled:
    """A follower's evaluator: never asked (only rank 0 evaluates); a call fails the test."""

    def submit(self, evaluator: str, content: str, deadline_ms: int) -> Any:
        raise AssertionError(f"rank 1 evaluated {evaluator} {content!r}")

    def flush(self) -> None:
        raise AssertionError("rank 1 flushed an evaluator")


class FINISH_ABORT:  # SGLang's abort reason, by the name the exchange reads
    def __init__(self, message: str) -> None:
        self.message = message


def _rank(rank: int, port: int, spin_wasm: str, diverge: bool, out: Any) -> None:
    """One rank: two spans (a value, and a guest that loops past its 300 ms deadline), then
    exchanges until both are published; with ``diverge``, rank 1 makes a decision rank 0 did
    not and exchanges once more."""
    import torch.distributed as dist

    from engine_adapter.sglang._rank_sync import RankDivergence, RankSync, torch_collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    inner: Any = NeverCalled()
    if rank == 0:
        from engine_adapter.evaluation import InProcessWasmEvaluator

        inner = InProcessWasmEvaluator([ROOT / "evaluators_wasm" / "wasm" / "calc.wasm", spin_wasm])
    try:
        group = SimpleNamespace(first_rank=0, cpu_group=dist.group.WORLD, world_size=2)
        sync = RankSync(rank, 2, *torch_collectives(group))
        evaluator = sync.evaluator(inner)
        value = evaluator.submit("calc", "6 * 7", 5000)
        late = evaluator.submit("spin", "x", 300)
        evaluator.flush()
        seen = []
        exchanges = 0
        while not (value.done() and late.done()) and exchanges < 5000:
            sync.exchange()  # both ranks loop on what the exchange published: the same count
            exchanges += 1
            seen.append((value.done(), late.done()))
            if rank == 0:
                time.sleep(0.002)
        results = [(f.result().value, f.result().error_code) for f in (value, late)]
        # Three compiled requests: rank 1 refused the second one's grammar; the third was
        # lowered into another text on each rank (the tenant's evaluators changed meanwhile).
        lowered = SimpleNamespace(evald_lowered_key="same text")
        reqs = [
            SimpleNamespace(rid="a", to_finish=None, grammar=lowered),
            SimpleNamespace(
                rid="b", to_finish=FINISH_ABORT("unknown evaluator 'x'") if rank == 1 else None
            ),
            SimpleNamespace(
                rid="c", to_finish=None, grammar=SimpleNamespace(evald_lowered_key=f"rev {rank}")
            ),
        ]
        refused: list[tuple[str, str]] = []
        sync.agree_on_refusals(reqs, lambda req, message: refused.append((req.rid, message)))
        results.append(refused)
        diverged = None
        if diverge:
            if rank == 1:
                sync.note("a decision rank 0 did not make")
            try:
                sync.exchange()
            except RankDivergence as exc:
                diverged = str(exc)
        out.put((rank, seen, results, diverged, sync.stats.published))
    finally:
        if rank == 0:
            inner.close()
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, diverge: bool) -> dict[int, Any]:
    from evald.testing import named_guest

    spin = tmp_path / "spin.wasm"
    spin.write_bytes(named_guest("loop", "spin"))
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, port, str(spin), diverge, out)) for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        found = {}
        for _ in ranks:
            rank, *rest = out.get(timeout=120)
            found[rank] = rest
        return found
    except queue.Empty:
        pytest.fail("a rank did not report within 120 s (a hang)")
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def test_every_rank_sees_each_outcome_at_the_same_exchange(tmp_path: Path) -> None:
    found = run_ranks(tmp_path, diverge=False)
    (seen0, results0, _, published0), (seen1, results1, _, published1) = found[0], found[1]
    assert results0[:2] == results1[:2] == [("42", None), (None, "deadline_exceeded")]
    # a grammar refused on one rank is refused on the other, with that rank's message
    assert results0[2][0] == ("b", "unknown evaluator 'x'")
    # grammars lowered from two revisions: refused on both ranks
    assert [rid for rid, _ in results0[2]] == ["b", "c"]
    assert [rid for rid, _ in results1[2]] == ["c"]
    assert "changed while this request's grammar was made" in results1[2][0][1]
    assert seen0 == seen1  # published at the same exchange on both ranks
    assert (True, False) in seen0  # the value came back before the late span's deadline
    assert published0 == published1 == 2


def test_a_rank_that_decides_otherwise_is_stopped_with_the_evidence(tmp_path: Path) -> None:
    found = run_ranks(tmp_path, diverge=True)
    assert found[0][2] is None  # rank 0 is the reference
    message = found[1][2]
    assert message is not None and "rank 1 diverged from rank 0" in message, message
