"""Tensor parallelism in real SGLang CPU servers (``--tp-size 2``, one core per rank): a span is
evaluated once, by rank 0, and every rank decides the same thing at the same step.

The rest of the real-server suite (test_sglang_server.py: values, errors, tenants, evald
stopped or killed, spinning and slow tenants, the OpenAI API, the span log, the forward
counters) runs against the two-rank server with the overlap scheduler, but for the tests marked
``one_rank`` (the benchmarks' runs, the CPU evald takes beside hogs); the one with the normal
scheduler runs the tests marked ``rank_agreement``, these among them. These tests check what
only two ranks have.
Each rank's scheduler logs with its rank (``TP0``, ``TP1``), so the server's log shows what each
decided.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, start_daemon
from test_sglang_server import (
    CONCURRENCY,
    evald_answer,
    finished_by_stop,
    run_all,
    spin_tag,
    tenant,
)

from engine_adapter.testing import fixed_tag, spans_in
from engine_adapter.testing._common import free_port
from engine_adapter.testing.sglang import CONFIG, SPIN_TOKEN, TOKEN, SglangServer

pytestmark = [pytest.mark.sglang_server, pytest.mark.rank_agreement]

_RANK_LINE = re.compile(r"^\[[^\]]* TP(\d+)\] (.*)$")


def rank_lines(log: str, needle: str) -> dict[int, list[str]]:
    """Per rank, the messages of the log lines that hold ``needle`` (timestamps dropped)."""
    ranks: dict[int, list[str]] = {}
    for line in log.splitlines():
        match = _RANK_LINE.match(line)
        if match and needle in match.group(2):
            ranks.setdefault(int(match.group(1)), []).append(match.group(2))
    return ranks


def evaluations(metrics_port: int) -> float:
    """The daemon's ``evald_evaluations_total``, every tenant and outcome."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("evald_evaluations_total{")
    )


@pytest.fixture
def counted_daemon(sglang_root: Path, fault_socket: Path) -> Any:
    """A fresh evald with its metrics served, at the address the servers allow per request."""
    fault_socket.unlink(missing_ok=True)
    port = free_port()
    config = CONFIG.replace("[server]\n", f'[server]\nmetrics_listen = "127.0.0.1:{port}"\n', 1)
    handle = start_daemon(
        sglang_root / "counted", config, socket_path=fault_socket, metrics_port=port
    )
    try:
        yield handle, port
    finally:
        handle.stop()


def two_ranks(server: SglangServer) -> None:
    if server.tp_size == 1:
        pytest.skip("one rank: nothing to agree on")


def test_each_span_is_evaluated_once_and_the_ranks_decide_alike(
    server: SglangServer, server_specs: Any, counted_daemon: tuple[Daemon, int]
) -> None:
    """Eight requests at once, values and errors: evald evaluates each span once (not once per
    rank), every value is evald's own, and both ranks log the same jumps in the same order
    (requests that came back, how many tokens) and the same exchanges; none diverged."""
    two_ranks(server)
    daemon, metrics_port = counted_daemon
    calc = server_specs["calc"].binding()
    params = tenant(TOKEN, evald_target=daemon.target)
    contents = [f"{i} * 13 + {i}" for i in range(CONCURRENCY - 1)] + ["1 / 0"]
    calls = [
        (lambda c=c: server.generate(
            "Compute:", max_new_tokens=120, custom_params=params,
            structural_tag=fixed_tag("So ", (calc, c), " and ", (calc, "2 + 2"), "."),
        ))
        for c in contents
    ]  # fmt: skip
    before = evaluations(metrics_port)
    answers = run_all(calls)
    for content, answer in zip(contents, answers, strict=True):
        found = spans_in(answer["text"])
        assert [f[1] for f in found] == [content, "2 + 2"], answer["text"]
        for tag, span_content, value, error in found:
            assert (value, error) == evald_answer(daemon, tag, span_content), answer["text"]
        assert finished_by_stop(answer), answer["meta_info"]
    # the answers above asked evald once more per span, through their own client
    assert evaluations(metrics_port) - before == 2 * 2 * len(contents)
    log = server.log()
    jumps = rank_lines(log, "evald adapter: jump batch")
    assert set(jumps) == {0, 1} and jumps[0] == jumps[1], jumps
    assert "diverged" not in log, log[-4000:]
    for rank in (0, 1):
        assert f"evald adapter: tensor-parallel rank {rank} of 2" in log


def test_late_values_are_decided_by_rank_0_for_every_rank(
    server: SglangServer, server_daemon: Daemon
) -> None:
    """A spinning tenant's spans end ``deadline_exceeded`` by rank 0's clock, published to both
    ranks in the same step: the requests finish, with the same jumps on both ranks."""
    two_ranks(server)
    tag = spin_tag(server_daemon, SPIN_TOKEN)
    calls = [
        (lambda: server.generate(
            "Compute:", max_new_tokens=80, structural_tag=tag, custom_params=tenant(SPIN_TOKEN)))
    ] * 2  # fmt: skip
    for answer in run_all(calls):
        assert answer["text"].count("deadline_exceeded") == 2, answer["text"]
        assert finished_by_stop(answer)
    log = server.log()
    jumps = rank_lines(log, "evald adapter: jump batch")
    assert jumps[0] == jumps[1], jumps
    assert "diverged" not in log
