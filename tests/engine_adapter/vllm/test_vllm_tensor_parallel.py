"""The adapter in a real vLLM CPU server with two tensor-parallel ranks
(``--tensor-parallel-size 2``, each rank a worker process bound to a CPU of its own), forcing
results through the verify step (the adapter's proposer), one server for the module
(``conftest.tp_server``).

vLLM runs one scheduler, in the engine core, for every rank: it sends each step's scheduled
requests, drafts and grammar bitmask to all ranks alike, so a span is evaluated once and every
rank forces the same tokens. Checked here: both ranks ran; values equal evald's own answers and
errors come in band, eight requests at once, each span evaluated exactly once (evald's own
count and the span log); a second tenant's evaluator serves only that tenant; a stopped evald
(``deadline_exceeded`` in band while plain requests keep streaming); and the single-rank
server's tests, collected again below against this server: the chat API, refused targets and
tokens, the span log, one verify forward per result, a computed-fields ``json_schema`` request
of another tenant.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import test_vllm_computed as computed
import test_vllm_server as single
from daemon_harness import Daemon
from test_vllm_server import (
    CONCURRENCY,
    assert_spans_timed_out,
    assert_under_a_deadline,
    beside_plain,
    calc_tag,
    evald_answer,
    run_all,
    spans_in,
    text_of,
    warm_up,
)

from engine_adapter.testing.vllm import (
    DEADLINE_MS,
    SPIN_TOKEN,
    TOKEN,
    VllmServer,
    fixed_tag,
    stopped,
    tag_body,
)
from evald.client import Client

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tp_server: VllmServer) -> VllmServer:
    """This module's server for the tests collected from the single-rank modules."""
    return tp_server


@pytest.fixture(scope="module")
def forcing() -> str:
    """How the tensor-parallel server forces results (``conftest.FORCING``)."""
    return "drafts"


@pytest.mark.timeout(900)  # the server starts (on a busy machine, minutes)
def test_two_ranks_serve_and_one_scheduler_runs_the_adapter(server: VllmServer) -> None:
    """The log names two ranks, each with OpenMP threads on CPUs of its own, and one scheduler
    with the adapter's tracker, the engine core's, for both (each rank's worker loads the
    plugin too; no scheduler runs there)."""
    assert server.tensor_parallel == 2
    answer = server.complete("The capital of France is", max_tokens=8)
    assert text_of(answer)
    assert "-tp2-" in answer["system_fingerprint"], answer["system_fingerprint"]
    log = server.log()
    for rank in (0, 1):
        assert f"world_size=2 rank={rank} " in log
    bound = {
        int(rank): {int(cpu) for cpu in cpus.split(",")}
        for rank, cpus in re.findall(r"local_rank=(\d+), core ids=\[([\d, ]+)\]", log)
    }
    assert set(bound) == {0, 1} and not bound[0] & bound[1], bound
    tracker = [line for line in log.splitlines() if "go through vLLM's verify step" in line]
    assert len(tracker) == 1 and tracker[0].startswith("(EngineCore"), tracker


def test_values_and_errors_each_evaluated_once(
    server: VllmServer, daemon: Daemon, specs: Any, span_log: Path
) -> None:
    """Eight completions at once, two spans each: every value is evald's own answer, errors
    come in band, and evald evaluated each closed span once (its own count), as the span log
    recorded it once: not once per rank."""
    calc = specs["calc"].binding()
    contents = [f"{101 + i} * {7 + i} + {i}" for i in range(CONCURRENCY - 2)]
    contents += ["49 / 0", "88888888888888888888 * 88888888888888888888"]
    before = evaluations(daemon)
    answers = run_all(
        [
            (lambda c=c: server.complete(
                "Compute:", max_tokens=160,
                **tag_body(fixed_tag("So ", (calc, c), " and ", (calc, "49 - 7"), "."),
                           evald_token=TOKEN),
            ))
            for c in contents
        ]
    )  # fmt: skip
    evaluated = evaluations(daemon) - before
    closed = [span for answer in answers for span in spans_in(text_of(answer))]
    assert len(closed) == 2 * CONCURRENCY, [text_of(a) for a in answers]
    assert evaluated == len(closed)
    errors = set()
    for content, answer in zip(contents, answers, strict=True):
        found = spans_in(text_of(answer))
        assert [f[1] for f in found] == [content, "49 - 7"], text_of(answer)
        for tag, span_content, value, error in found:
            assert (value, error) == evald_answer(daemon, tag, span_content), text_of(answer)
            errors.add(error)
        assert answer["choices"][0]["finish_reason"] == "stop"
    assert "division_by_zero" in errors
    logged = logged_contents(span_log, set(contents))
    assert sorted(logged) == sorted(contents), logged


def evaluations(daemon: Daemon, tenant: str = "vllm") -> float:
    """How many evaluations ``daemon`` finished for ``tenant``, every evaluator and outcome
    (its own ``evald_evaluations_total``): what reached evald, whichever process sent it."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics") as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "evald_evaluations_total" and sample.labels.get("tenant") == tenant
    )


def logged_contents(span_log: Path, contents: set[str]) -> list[str]:
    """The span log's lines whose content is one of ``contents``, once their requests have
    ended (each request writes its spans when it ends)."""
    found: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in span_log.read_text().splitlines()]
        found = [line["content"] for line in lines if line["content"] in contents]
        if len(set(found)) == len(contents):
            break
        time.sleep(0.2)
    return found


def test_a_tenants_own_evaluator_serves_only_that_tenant(
    server: VllmServer, daemon: Daemon
) -> None:
    """An evaluator registered by one tenant (``secret49``, which echoes its input): that
    tenant's requests get its value; the server's own tenant, asking for the same span, gets
    ``unknown_evaluator`` in band, four of each at once."""
    from engine_adapter import list_evaluators
    from evald.testing import named_guest

    with Client(daemon.target, SPIN_TOKEN) as client:
        client.register(named_guest("echo", "secret49"), replace=True)
    assert "secret49" not in {s.name for s in list_evaluators(daemon.target, TOKEN)}
    secret = {s.name: s for s in list_evaluators(daemon.target, SPIN_TOKEN)}["secret49"]
    tag = fixed_tag("X ", (secret.binding(), "abc"), ".")
    half = CONCURRENCY // 2
    answers = run_all(
        [lambda: server.complete("Say:", max_tokens=60, **tag_body(tag, evald_token=SPIN_TOKEN))]
        * half
        + [lambda: server.complete("Say:", max_tokens=60, **tag_body(tag, evald_token=TOKEN))]
        * half
    )
    for answer in answers[:half]:
        assert spans_in(text_of(answer)) == [("secret49", "abc", "abc", None)], text_of(answer)
    for answer in answers[half:]:
        found = spans_in(text_of(answer))
        assert found == [("secret49", "abc", None, "unknown_evaluator")], text_of(answer)


def test_stopped_evald_ends_every_span_in_band_while_plain_tokens_keep_coming(
    server: VllmServer, specs: Any, fault_daemon: Daemon
) -> None:
    """evald stopped (SIGSTOP, continued however the block ends): both spans of six
    completions end ``deadline_exceeded`` in band, one deadline after the other, and every
    completion finishes, while two plain streams next to them keep coming, never a span
    deadline between two tokens (a plain request that waited for a held span would).

    The single-rank test also bounds the plain streams' longest gap by the same requests'
    next to answered spans (1.5 times, at least 1 s). Not here: each step needs both ranks, each
    bound to one of the 2 shared cores, so any other process's time slice on either core
    delays every token (observed: 1.01 s against 0.46 s, at a load average of 18 beside a
    TP = 2 SGLang server), which says nothing about the adapter."""
    body = tag_body(calc_tag(specs), evald_token=TOKEN, evald_target=fault_daemon.target)
    warm_up(server, body)
    with stopped(fault_daemon.pid):
        started = time.monotonic()
        answers = beside_plain(server, body)
        elapsed = time.monotonic() - started
    assert_spans_timed_out(answers)
    assert elapsed >= 2 * DEADLINE_MS / 1000.0  # two spans, one after the other, each timed out
    for text, times in answers[CONCURRENCY - 2 :]:
        assert text and len(times) > 1, (text, times)
    assert_under_a_deadline(answers)


# The single-rank server's tests, run again here against the two ranks (this module's `server`
# and `forcing` fixtures stand in for the session's). The span log test reads the chat test's
# span, so it comes after it.
test_openai_response_format_and_unknown_evaluator = (
    single.test_openai_response_format_and_unknown_evaluator
)
test_refused_target_and_bad_token_answer_in_band = (
    single.test_refused_target_and_bad_token_answer_in_band
)
test_span_log_records_every_span = single.test_span_log_records_every_span
test_forwards_per_result_from_the_servers_counters = (
    single.test_forwards_per_result_from_the_servers_counters
)
test_openai_response_format_with_a_request_tenants_policy = (
    computed.test_openai_response_format_with_a_request_tenants_policy
)
