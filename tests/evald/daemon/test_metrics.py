"""The daemon's metrics: a worker's deferred tally adds up to exactly what per-evaluation
observations give, and stays invisible until its thread flushes it."""

from __future__ import annotations

import re
import threading

from evald.daemon._metrics import Metrics

EVALUATIONS = [
    ("local", "calc", "ok", 4, 1845),
    ("local", "calc", "ok", 12, 2000),
    ("local", "calc", "ok", 10, 1000),  # exactly on a bucket bound: it counts in that bucket
    ("local", "calc", "syntax", 3, 900),
    ("team", "strop", "ok", 70_000, 5_000_000),
    ("team", "strop", "quota_exceeded", 0, 0),
    ("local", "calc", "ok", 2_000_000, 20_000_000_000),  # past the last bucket
]


def samples(metrics: Metrics) -> dict[str, float]:
    """Every evaluation sample of the exposition (``*_created`` timestamps left out)."""
    out = {}
    for line in metrics.render().decode().splitlines():
        match = re.match(r"^(evald_(?:evaluation|fuel)\S*) (\S+)$", line)
        if match and "_created" not in match.group(1):
            out[match.group(1)] = float(match.group(2))
    return out


def test_a_flushed_tally_equals_one_observation_per_evaluation() -> None:
    observed, tallied = Metrics(), Metrics()
    for evaluation in EVALUATIONS:
        observed.observe_evaluation(*evaluation)
        tallied.tally_evaluation(*evaluation)
    assert not samples(tallied).get(
        'evald_evaluations_total{evaluator="calc",outcome="ok",tenant="local"}'
    )
    tallied.flush_tally()
    expected = samples(observed)
    assert expected['evald_evaluations_total{evaluator="calc",outcome="ok",tenant="local"}'] == 4
    assert samples(tallied) == expected
    tallied.flush_tally()  # an empty tally changes nothing
    assert samples(tallied) == expected


def test_each_thread_flushes_only_its_own_tally() -> None:
    metrics = Metrics()
    metrics.tally_evaluation("local", "calc", "ok", 5, 100)

    def other() -> None:
        metrics.tally_evaluation("local", "calc", "ok", 5, 100)
        metrics.flush_tally()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    key = 'evald_evaluations_total{evaluator="calc",outcome="ok",tenant="local"}'
    assert samples(metrics)[key] == 1
    metrics.flush_tally()
    assert samples(metrics)[key] == 2
