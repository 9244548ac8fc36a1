"""The adapter in real SGLang CPU servers: values, errors, tenants, faults, untouched requests, no
stall, and a whole result in one forward — under both of SGLang's schedulers.

One server per scheduler for the session (``conftest.server``, ``normal`` then ``overlap``),
launched as a user launches it; at least eight requests run concurrently in each test. Span
contents are fixed by the request's structural tag (the model writes them, the grammar allowing
nothing else); every injected value is checked against evald's own answer.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon

from engine_adapter.serving._server_runtime import LISTING_MEMORY_S
from engine_adapter.testing import PLAIN_PROMPTS as ALL_PLAIN_PROMPTS
from engine_adapter.testing import (
    STALL_FACTOR,
    STALL_FLOOR_S,
    fixed_tag,
    has_amx,
    longest_gap,
    spans_in,
    stopped,
)
from engine_adapter.testing.sglang import (
    DEADLINE_MS,
    OTHER_TOKEN,
    SLOW_TOKEN,
    SPIN_TOKEN,
    TOKEN,
    SglangServer,
)
from evald.client import Client
from evald.testing import cpu_hogs, process_cpu_s

#: Why a benchmark check skips: the benchmarks are the lab's.
LAB_NEEDED = "the benchmarks come with the lab (pip install -e ./lab)"

pytestmark = pytest.mark.sglang_server

CONCURRENCY = 8
PLAIN_PROMPTS = ALL_PLAIN_PROMPTS[:4]


def evald_answer(
    daemon: Daemon, evaluator: str, content: str, token: str = TOKEN
) -> tuple[str | None, str | None]:
    from evald.contract import ErrorCode

    with Client(daemon.target, token) as client:
        response = client.evaluate(evaluator, content)
    if response.WhichOneof("outcome") == "value":
        return response.value, None
    return None, ErrorCode.from_proto(response.error.code).value


def run_all(calls: list[Any]) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def tenant(token: str, **more: str) -> dict[str, str]:
    """The request's ``custom_params`` naming its tenant."""
    return {"evald_token": token, **more}


def finished_by_stop(answer: dict[str, Any]) -> bool:
    return bool(answer["meta_info"]["finish_reason"]["type"] == "stop")


@pytest.mark.rank_agreement
@pytest.mark.timeout(900)  # the first test of a scheduler starts its server (minutes when loaded)
def test_values_and_errors_match_evald(
    server: SglangServer, server_daemon: Daemon, server_specs: Any
) -> None:
    calc = server_specs["calc"].binding()
    contents = [f"{17 + i} * {23 + i} + {91 * i}" for i in range(CONCURRENCY - 2)]
    contents += ["1 / 0", "99999999999999999999 * 99999999999999999999"]
    calls = [
        (lambda c=c: server.generate(
            "Compute:", max_new_tokens=160,
            structural_tag=fixed_tag("So ", (calc, c), " and ", (calc, "2 + 2"), "."),
        ))
        for c in contents
    ]  # fmt: skip
    errors = set()
    for content, answer in zip(contents, run_all(calls), strict=True):
        text = answer["text"]
        found = spans_in(text)
        assert [f[1] for f in found] == [content, "2 + 2"], text
        for tag, span_content, value, error in found:
            assert (value, error) == evald_answer(server_daemon, tag, span_content), text
            if error:
                errors.add(error)
        assert finished_by_stop(answer), answer["meta_info"]
    assert "division_by_zero" in errors


def test_openai_chat_api_with_a_request_tenant(server: SglangServer, server_specs: Any) -> None:
    """The lowered tag through ``response_format``, the tenant through ``custom_params``; an
    opener that no evaluator has answers ``unknown_evaluator`` in band."""
    from dataclasses import replace

    calc = server_specs["calc"].binding()
    nope = replace(calc, evaluator="nope", begin="<nope>", end="</nope>")
    tag = fixed_tag("So ", (calc, "6 * 7"), " and ", (nope, "1 + 1"), ".")
    calls = [
        (lambda: server.chat(
            [{"role": "user", "content": "Compute 6 * 7."}], max_tokens=120,
            response_format=tag, custom_params=tenant(TOKEN),
        ))
    ] * CONCURRENCY  # fmt: skip
    for answer in run_all(calls):
        text = answer["choices"][0]["message"]["content"]
        assert spans_in(text) == [
            ("calc", "6 * 7", "42", None),
            ("nope", "1 + 1", None, "unknown_evaluator"),
        ], text


@pytest.mark.timeout(900)  # the plugin-off server starts inside it (once per session)
def test_untouched_requests_are_unchanged(
    server: SglangServer, server_specs: Any, plugin_off_texts: dict[str, str]
) -> None:
    """Requests without spans write what a server without the adapter writes, alone and next to
    evaluated requests."""
    alone = [server.generate(p, max_new_tokens=24)["text"] for p in PLAIN_PROMPTS]
    assert alone == [plugin_off_texts[p] for p in PLAIN_PROMPTS]
    calc = server_specs["calc"].binding()
    evaluated = [
        (lambda i=i: server.generate(
            "Compute:", max_new_tokens=120,
            structural_tag=fixed_tag("So ", (calc, f"{i} * 7"), " then ", (calc, f"{i} + 1"), "."),
        ))
        for i in range(CONCURRENCY - len(PLAIN_PROMPTS))
    ]  # fmt: skip
    plain = [(lambda p=p: server.generate(p, max_new_tokens=24)) for p in PLAIN_PROMPTS]
    answers = run_all(plain + evaluated)
    texts = [a["text"] for a in answers[: len(PLAIN_PROMPTS)]]
    if has_amx():
        # bf16 (the CPU kernel's only dtype on AMX): a greedy text depends on the batch's other
        # rows with or without the adapter, so next to other requests only the adapter's own
        # marks are checked; fp32 (no AMX) compares the texts exactly.
        for text in texts:
            assert text and "<result>" not in text, text
    else:
        assert texts == alone
    for i, answer in enumerate(answers[len(PLAIN_PROMPTS) :]):
        assert f"<result>{i * 7}</result>" in answer["text"], answer["text"]
        assert f"<result>{i + 1}</result>" in answer["text"], answer["text"]


def test_evaluated_tags_are_lowered_with_the_requests_tenant(
    server: SglangServer, server_daemon: Daemon
) -> None:
    """A tenant's own evaluator: its requests reach it, another tenant's same request does not,
    whether the tag is lowered by the client or by the server, and a bad token or a foreign
    evald address is refused in band. No token reaches the server's log or its metrics."""
    from engine_adapter import list_evaluators

    secret = register_secret(server_daemon).binding()
    assert "secret" not in {s.name for s in list_evaluators(server_daemon.target, OTHER_TOKEN)}
    # A server's listing younger than LISTING_MEMORY_S answers for the refresh an unknown name
    # asks for (docs/sglang.md): past it, the tag lowered on the server finds ``secret``.
    time.sleep(LISTING_MEMORY_S)
    lowered = fixed_tag("X ", (secret, "abc"), ".")
    unlowered = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "X "},
        {"type": "evaluated_tag", "begin": "<secret>", "end": "</secret>", "evaluator": "secret",
         "content": {"type": "const_string", "value": "abc"},
         "result": {"begin": "<result>", "end": "</result>"}},
        {"type": "const_string", "value": "."}]}}  # fmt: skip
    bad = "not-a-tenant-token-0123456789abcdef"

    def ask(tag: dict[str, Any], params: dict[str, str] | None) -> dict[str, Any] | str:
        try:
            return server.generate(
                "Say:", max_new_tokens=40, structural_tag=tag, custom_params=params
            )
        except AssertionError as exc:  # an HTTP error: the grammar could not be made
            return str(exc)

    calls = [
        lambda: ask(lowered, tenant(TOKEN)),
        lambda: ask(lowered, tenant(OTHER_TOKEN)),
        lambda: ask(lowered, tenant(bad)),
        lambda: ask(unlowered, tenant(TOKEN)),
        lambda: ask(unlowered, tenant(OTHER_TOKEN)),
        lambda: ask(lowered, None),  # the server's own token (the owner's)
        lambda: ask(lowered, tenant(TOKEN, evald_target="127.0.0.1:1")),
        lambda: ask(lowered, tenant(OTHER_TOKEN)),
        lambda: ask(lowered, tenant("")),  # named but empty: never the server's tenant
        lambda: ask(lowered, tenant("  ")),
    ]
    answers = run_all(calls)
    own, other, refused, own_lowered_here, other_lowered_here, default, far, other_again = answers[
        :8
    ]
    for blank in answers[8:]:
        assert isinstance(blank, dict)
        assert spans_in(blank["text"])[0][3] == "permission_denied", blank["text"]
    expected = "X <secret>abc</secret><result>abc</result>."
    assert isinstance(own, dict) and own["text"] == expected, own
    assert isinstance(own_lowered_here, dict) and own_lowered_here["text"] == expected
    assert isinstance(default, dict) and default["text"] == expected
    for answer in (other, other_again):  # the same tag text: never the owner's grammar object
        assert isinstance(answer, dict)
        assert spans_in(answer["text"])[0][3] == "unknown_evaluator", answer["text"]
    assert isinstance(refused, dict)
    assert spans_in(refused["text"])[0][3] == "permission_denied", refused["text"]
    assert isinstance(far, dict) and spans_in(far["text"])[0][3] == "permission_denied", far
    assert isinstance(other_lowered_here, str)  # lowered with the other tenant's evaluators
    assert "unknown evaluator 'secret'" in other_lowered_here, other_lowered_here
    metrics = json.dumps(server.metrics())
    log = server.log()
    for token in (TOKEN, OTHER_TOKEN, bad):
        assert token not in log and token not in metrics


def beside_plain(
    server: SglangServer, tag: dict[str, Any], params: dict[str, str], plain_tokens: int = 48
) -> list[Any]:
    """``CONCURRENCY - 2`` evaluated requests under ``tag`` beside two plain streamed ones, all
    at once: the evaluated answers, then the plain ``(text, chunk times)``."""
    evaluated = [
        (lambda: server.generate(
            "Compute:", max_new_tokens=120, structural_tag=tag, custom_params=params))
    ] * (CONCURRENCY - 2)  # fmt: skip
    streamed = [
        (lambda p=p: server.stream(p, max_new_tokens=plain_tokens, ignore_eos=True))
        for p in PLAIN_PROMPTS[:2]
    ]
    return run_all(evaluated + streamed)


def assert_plain_kept_pace(
    answers: list[Any], fast: list[Any], arm: str = "", server: SglangServer | None = None
) -> None:
    """The plain requests' tokens came as they do next to spans evald answers at once (``fast``:
    the same requests just before, on the same machine, so a busy machine slows both alike).
    The floor keeps a quiet machine's few-ms jitter from deciding; on a machine whose own steps
    are fast the bound is well under one span deadline (the quiet tests assert that too).

    With two tensor-parallel ranks on two cores the floor is one second per rank: the six late
    requests' error regions (102 tokens) come back in one extend forward, which the plain
    requests wait for (as for any prefill) and which takes about a second there, against the
    fast arm's 54-token values."""
    plain = CONCURRENCY - 2
    fast_longest = max(longest_gap(times) for _, times in fast[plain:])
    floor = STALL_FLOOR_S * (server.tp_size if server is not None else 1)
    bound = max(STALL_FACTOR * fast_longest, floor)
    for text, times in answers[plain:]:
        assert text and len(times) > 1
        assert longest_gap(times) <= bound, (arm, longest_gap(times), fast_longest, times)


def assert_spans_timed_out(answers: list[Any]) -> None:
    """Both spans of every evaluated request ended ``deadline_exceeded``, and it finished."""
    for answer in answers[: CONCURRENCY - 2]:
        found = spans_in(answer["text"])
        assert [f[3] for f in found] == ["deadline_exceeded"] * 2, answer["text"]
        assert finished_by_stop(answer)


def warm_up(server: SglangServer, tag: dict[str, Any], params: dict[str, str]) -> None:
    """Until the adapter's stream to the fault tests' fresh evald is up: the one before it, at
    the same socket, ended with the last test, and until the adapter's reconnect (backoff up
    to 2 s) spans to it fail at once with ``unavailable``."""
    for _ in range(10):
        warm = server.generate(
            "Compute:", max_new_tokens=120, structural_tag=tag, custom_params=params
        )
        if [f[2] for f in spans_in(warm["text"])] == ["9", "16"]:
            return
        time.sleep(1.0)
    raise AssertionError(f"the adapter never reached the fault evald: {warm['text']}")


def calc_tag(server_specs: Any) -> dict[str, Any]:
    """Two calc spans (``9`` and ``16``), as the fast arm and the fault tests write them."""
    calc = server_specs["calc"].binding()
    return fixed_tag("So ", (calc, "3 * 3"), " and ", (calc, "4 * 4"), ".")


def spin_tag(daemon: Daemon, token: str) -> dict[str, Any]:
    """Two spans of ``token``'s tenant's evaluator that loops until its deadline."""
    spin = register_spinner(daemon, token).binding()
    return fixed_tag("So ", (spin, "x"), " and ", (spin, "y"), ".")


#: A late tenant: ``spinning`` loops until the span's deadline (3 s), ``slow`` until its
#: tenant's 400 ms limit (evald has 2 workers; six requests' spans come at once).
LATE_TOKENS = {"spinning": SPIN_TOKEN, "slow": SLOW_TOKEN}


#: What the scheduler thread may have waited for one span's value, as the span log says: the
#: step budget (engine_adapter.serving._step_wait, 5 ms) and a busy machine's slack, far below a
#: span deadline. A span whose request sat out its steps waited 0.
WAITED_MS_BOUND = 500.0


def spans_logged_since(span_log: Path, offset: int) -> list[dict[str, Any]]:
    """The span log's lines appended after ``offset`` bytes (its size before a test's run)."""
    with span_log.open("rb") as log:
        log.seek(offset)
        return [json.loads(line) for line in log.read().decode().splitlines() if line]


def spans_logged_by_then(span_log: Path, offset: int, count: int) -> list[dict[str, Any]]:
    """:func:`spans_logged_since`, once ``count`` lines are there or 10 s have passed (a span
    is logged the step after its region completes, which may follow the response)."""
    deadline = time.monotonic() + 10
    while True:
        lines = spans_logged_since(span_log, offset) if span_log.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def region_forwards_at_most(server: SglangServer) -> int:
    """The forwards a result region takes alone on the server: its extend, and with the
    overlap scheduler a decode step already launched when its span closed, before it."""
    return 2 if server.scheduler == "overlap" else 1


def log_offset(span_log: Path) -> int:
    return span_log.stat().st_size if span_log.exists() else 0


def assert_no_step_waited(spans: list[dict[str, Any]], evaluator: str, count: int) -> None:
    """``count`` spans of ``evaluator`` were logged, and none held the scheduler's step for its
    value longer than the step budget (what the adapter decided, whatever the machine's load)."""
    mine = [span for span in spans if span["evaluator"] == evaluator]
    assert len(mine) == count, mine
    assert max(span["waited_ms"] for span in mine) <= WAITED_MS_BOUND, mine


def assert_never_a_deadline_apart(server: SglangServer, answers: list[Any]) -> None:
    """No plain request's tokens came a span deadline apart (a step that waited for a late
    value would hold them that long).

    With two tensor-parallel ranks on two cores, one per rank, a step of eight requests takes
    most of a second on this CPU and several when the machine is busy, so a gap of one span
    deadline cannot be told from a few slow steps there; what the scheduler decided says it
    instead (the span log's ``waited_ms``, :func:`assert_no_step_waited`, in every test that
    calls this)."""
    if server.tp_size == 1:
        assert max(longest_gap(times) for _, times in answers[CONCURRENCY - 2 :]) < (
            DEADLINE_MS / 1e3
        )


@pytest.mark.rank_agreement
def test_hung_evald_ends_every_span_without_stalling_others(
    server: SglangServer, server_specs: Any, fault_daemon: Daemon, span_log: Path
) -> None:
    """evald stopped (SIGSTOP) mid-run: every span ends at its deadline with
    ``deadline_exceeded``, every request finishes, and a plain request's tokens keep pace, never
    a span deadline apart."""
    tag = calc_tag(server_specs)
    params = tenant(TOKEN, evald_target=fault_daemon.target)
    warm_up(server, tag, params)
    fast = beside_plain(server, tag, params)
    offset = log_offset(span_log)
    with stopped(fault_daemon.pid):
        started = time.monotonic()
        answers = beside_plain(server, tag, params)
        elapsed = time.monotonic() - started
    assert_spans_timed_out(answers)
    assert elapsed >= 2 * DEADLINE_MS / 1000.0  # two spans, one after the other, each timed out
    assert elapsed < 2 * DEADLINE_MS / 1000.0 + 60.0 * server.tp_size
    assert_plain_kept_pace(answers, fast, server=server)
    assert_never_a_deadline_apart(server, answers)
    assert_no_step_waited(spans_logged_since(span_log, offset), "calc", 2 * (CONCURRENCY - 2))


@pytest.mark.parametrize("late", list(LATE_TOKENS))
def test_a_plain_request_keeps_pace_beside_another_tenants_late_evaluator(
    server: SglangServer, server_daemon: Daemon, server_specs: Any, late: str, span_log: Path
) -> None:
    """Another tenant's evaluator that takes all the CPU it may, both spans of each of six
    requests at once: their spans end ``deadline_exceeded``, and a plain request's tokens keep
    pace with the same requests' next to ``calc`` spans, never a span deadline apart."""
    token = LATE_TOKENS[late]
    late_tag = spin_tag(server_daemon, token)
    fast = beside_plain(server, calc_tag(server_specs), tenant(TOKEN))
    offset = log_offset(span_log)
    answers = beside_plain(server, late_tag, tenant(token))
    for answer in fast[: CONCURRENCY - 2]:
        assert [f[2] for f in spans_in(answer["text"])] == ["9", "16"], answer["text"]
    assert_spans_timed_out(answers)
    assert_plain_kept_pace(answers, fast, server=server)
    assert_never_a_deadline_apart(server, answers)
    assert_no_step_waited(spans_logged_since(span_log, offset), "spin", 2 * (CONCURRENCY - 2))


def test_result_openers_that_share_nothing_freeze_no_one(
    server: SglangServer, server_daemon: Daemon, server_specs: Any, span_log: Path
) -> None:
    """A tenant's request may give its result and error regions openers with no shared first
    character (``[`` / ``{``). The overlap scheduler has such a request in a step built before
    its span closed, with nothing of the region to force before the value: that step must not
    wait for another tenant's spinning evaluator. Its spans end in band (at the step's budget,
    or at their deadline while the request sits out) and the plain streams keep pace."""
    from dataclasses import replace

    spin = replace(
        register_spinner(server_daemon, SPIN_TOKEN).binding(),
        result_begin="[", result_end="]", error_begin="{", error_end="}",
    )  # fmt: skip
    late_tag = fixed_tag("So ", (spin, "x"), " and ", (spin, "y"), ".")
    fast = beside_plain(server, calc_tag(server_specs), tenant(TOKEN))
    offset = log_offset(span_log)
    answers = beside_plain(server, late_tag, tenant(SPIN_TOKEN))
    expected = "So <spin>x</spin>{deadline_exceeded} and <spin>y</spin>{deadline_exceeded}."
    for answer in answers[: CONCURRENCY - 2]:
        assert answer["text"] == expected and finished_by_stop(answer), answer
    assert_plain_kept_pace(answers, fast, server=server)
    assert_never_a_deadline_apart(server, answers)
    assert_no_step_waited(spans_logged_since(span_log, offset), "spin", 2 * (CONCURRENCY - 2))


#: Beside the hogs, the CPU evald may take while another tenant's spans spin, as a share of
#: what those calls ask for (two spans, each on evald's two workers for the 3 s span
#: deadline). Measured on 2 cores: 0.10 with evald's workers and group lowered, 0.43 with its
#: group left at the engine's weight.
SPIN_WANTS_CPU_S = 2 * 2 * DEADLINE_MS / 1000.0
BUSY_EVALD_SHARE = 0.25


@pytest.mark.timeout(1200)  # beside the hogs SGLang's forward steps take seconds
@pytest.mark.one_rank
@pytest.mark.overlap_only  # what it bounds, evald's CPU, does not depend on the scheduler
def test_late_values_leave_a_busy_machine_to_the_engine(
    server: SglangServer,
    server_daemon: Daemon,
    server_specs: Any,
    fault_daemon: Daemon,
    span_log: Path,
) -> None:
    """The stall tests above, beside two CPU hogs (processes of the test's session that
    busy-loop, as ``yes > /dev/null &`` twice would): a user's server is rarely quiet. Every
    late span (spinning, a stopped evald) ends ``deadline_exceeded``, every request
    finishes with all its tokens, and evald, whose spinning calls want both cores, takes almost
    none of them: the CPU stays with the engine and the machine's other work.

    The plain requests' gaps are not bounded here: beside the hogs SGLang's forward, whose
    OpenMP threads are bound one to a core, takes seconds per step on its own, with evald idle
    (docs/sglang.md, "Where a plain request waits"), so gaps compare no better than 2x between
    two runs of the same arm; the quiet tests above bound them."""
    tag = calc_tag(server_specs)
    fault = tenant(TOKEN, evald_target=fault_daemon.target)
    warm_up(server, tag, fault)
    spinning = spin_tag(server_daemon, SPIN_TOKEN)
    arms: dict[str, list[Any]] = {}
    offset = log_offset(span_log)
    with cpu_hogs(2):
        before = process_cpu_s(server_daemon.pid)
        arms["spinning"] = beside_plain(server, spinning, tenant(SPIN_TOKEN), plain_tokens=16)
        after = process_cpu_s(server_daemon.pid)
        with stopped(fault_daemon.pid):
            arms["stopped"] = beside_plain(server, tag, fault, plain_tokens=16)
    for late, answers in arms.items():
        assert_spans_timed_out(answers)
        for text, times in answers[CONCURRENCY - 2 :]:
            assert text and len(times) == 16, (late, text, times)
    logged = spans_logged_since(span_log, offset)
    assert_no_step_waited(logged, "spin", 2 * (CONCURRENCY - 2))
    assert_no_step_waited(logged, "calc", 2 * (CONCURRENCY - 2))
    assert before is not None and after is not None
    share = (after - before) / SPIN_WANTS_CPU_S
    print(f"evald CPU ÷ what the spinning calls asked for: {share:.3f}")
    assert share <= BUSY_EVALD_SHARE, share


@pytest.mark.rank_agreement
def test_killed_evald_answers_unavailable(
    server: SglangServer, server_specs: Any, fault_daemon: Daemon
) -> None:
    calc = server_specs["calc"].binding()
    params = tenant(TOKEN, evald_target=fault_daemon.target)
    tag = fixed_tag("So ", (calc, "5 * 5"), ".")
    first = server.generate("Compute:", max_new_tokens=80, structural_tag=tag, custom_params=params)
    assert spans_in(first["text"])[0][2] == "25"
    fault_daemon.process.send_signal(signal.SIGKILL)
    fault_daemon.process.wait(timeout=10)
    calls = [
        (lambda: server.generate(
            "Compute:", max_new_tokens=80, structural_tag=tag, custom_params=params))
    ] * CONCURRENCY  # fmt: skip
    for answer in run_all(calls):
        assert spans_in(answer["text"])[0][3] == "unavailable", answer["text"]
        assert finished_by_stop(answer)


@pytest.mark.rank_agreement
def test_requests_aborted_while_their_span_waits_finish_and_free_their_kv(
    server: SglangServer, server_daemon: Daemon, server_specs: Any
) -> None:
    """``/abort_request`` for requests that sit out the batch while their evaluator spins: they
    end aborted and the scheduler drops them (they never decode on), the server keeps serving,
    and their KV is freed (SGLang's idle-time leak check stops the scheduler otherwise)."""
    spin = register_spinner(server_daemon).binding()
    # A long constant after the span: a request the scheduler kept would decode it.
    tail = " and after that the model goes on writing one token at a time for quite a while."
    tag = fixed_tag("So ", (spin, "x"), tail * 2)
    half = CONCURRENCY // 2

    closed = [threading.Event() for _ in range(half)]

    def parked(i: int) -> dict[str, Any]:
        """Streams request ``i``, flags when its span has closed, returns its last chunk."""
        body = {
            "text": "Compute:", "rid": f"parked-{server.name}-{i}", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 120,
                                "structural_tag": json.dumps(tag),
                                "custom_params": tenant(SPIN_TOKEN)},
        }  # fmt: skip
        request = urllib.request.Request(
            f"{server.url}/generate", data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        last: dict[str, Any] = {}
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    last = json.loads(line[5:])
                    if "</spin>" in last.get("text", ""):
                        closed[i].set()
        return last

    with concurrent.futures.ThreadPoolExecutor(half) as pool:
        futures = [pool.submit(parked, i) for i in range(half)]
        for event in closed:  # every span has closed: the requests sit out, waiting
            assert event.wait(timeout=120)
        time.sleep(0.3)
        passes = server.forward_passes()
        for i in range(half):
            server.abort(f"parked-{server.name}-{i}")
        results = [f.result() for f in futures]
    for answer in results:
        assert answer["meta_info"]["finish_reason"]["type"] == "abort", answer["meta_info"]
        # It never got its region (with the overlap scheduler, the steps already launched when
        # its span closed forced the shared "<result" prefix).
        assert "<result>" not in answer["text"] and "<result_error>" not in answer["text"]
    # The scheduler really dropped them: they do not decode on once their spans time out.
    time.sleep(DEADLINE_MS / 1000.0 + 2.0)
    after = server.forward_passes()
    assert after["decode"] - passes["decode"] < 10, (passes, after)
    calc = server_specs["calc"].binding()
    calls = [
        (lambda i=i: server.generate(
            "Compute:", max_new_tokens=60,
            structural_tag=fixed_tag("So ", (calc, f"{i} * 2"), ".")))
        for i in range(CONCURRENCY)
    ]  # fmt: skip
    for i, answer in enumerate(run_all(calls)):
        assert spans_in(answer["text"])[0][2] == str(i * 2)
    log = server.log()
    assert "leak" not in log.lower() and "Traceback" not in log, log[-3000:]


def test_a_whole_result_in_one_forward(
    server: SglangServer, server_specs: Any, span_log: Path
) -> None:
    """The server's own forward counters (``sglang:cuda_graph_passes_total``): a request's
    result regions do not cost a forward per token. Alone on the server, each region goes in
    with one extend; with the overlap scheduler, a decode step already launched when the span
    closed may force its first token first (the span log says, per region, what happened).
    """
    from engine_adapter.local import load_tokenizer

    calc = server_specs["calc"].binding()
    tag = fixed_tag("So ", (calc, "17 * 23 + 91"), " and ", (calc, "1 / 0"), ".")
    # The overlap scheduler may launch one more step before it sees that a request ended (it
    # races the end of the grammar, so a request costs one forward per token, or one more).
    past_the_end = {0, 1} if server.scheduler == "overlap" else {0}
    before = server.forward_passes()
    plain = server.generate(
        "Compute:", max_new_tokens=120, structural_tag=fixed_tag("So 482 and an error.")
    )
    after = server.forward_passes()
    assert plain["text"] == "So 482 and an error." and finished_by_stop(plain)
    plain_forwards = sum(after.values()) - sum(before.values())
    assert plain_forwards - plain["meta_info"]["completion_tokens"] in past_the_end, (
        before, after, plain["meta_info"],
    )  # fmt: skip
    offset = log_offset(span_log)
    before = server.forward_passes()
    answer = server.generate("Compute:", max_new_tokens=120, structural_tag=tag)
    after = server.forward_passes()
    text = answer["text"]
    regions = ["<result>482</result>", "<result_error>division_by_zero</result_error>"]
    assert spans_in(text) == [
        ("calc", "17 * 23 + 91", "482", None), ("calc", "1 / 0", None, "division_by_zero")
    ]  # fmt: skip
    lines = spans_logged_by_then(span_log, offset, count=len(regions))
    assert [line["content"] for line in lines] == ["17 * 23 + 91", "1 / 0"], lines
    most = region_forwards_at_most(server)
    assert all(1 <= line["forwards"] <= most for line in lines), lines
    # Decode steps that forced a region's first token before its extend.
    forced_first = sum(line["forwards"] - 1 for line in lines)
    tokenizer = load_tokenizer()
    region_tokens = sum(len(tokenizer.encode(r, add_special_tokens=False)) for r in regions)
    completion = int(answer["meta_info"]["completion_tokens"])
    forwards = sum(after.values()) - sum(before.values())
    # Per token: 1 prefill + one forward per further token. Here each region's tokens (but for
    # one forced in a step already launched) ride in one extend with the closing token.
    assert forwards - (completion - region_tokens + forced_first) in past_the_end, (
        before, after, lines,
    )  # fmt: skip
    assert after["prefill"] - before["prefill"] == 1 + len(regions)


def test_span_log_records_every_span(
    server: SglangServer, span_log: Path, server_specs: Any
) -> None:
    """``EVALD_SPAN_LOG``: one JSON line per finished span, with the forwards its region took
    (one extend; with the overlap scheduler one forced decode step before it at most), and no
    scheduler wait: waiting requests sit out."""
    calc = server_specs["calc"].binding()
    contents = [f"{i} * 7 + {i}" for i in range(100, 100 + CONCURRENCY)]
    calls = [
        (lambda c=c: server.generate(
            "Compute:", max_new_tokens=60, structural_tag=fixed_tag("So ", (calc, c), ".")))
        for c in contents
    ]  # fmt: skip
    offset = log_offset(span_log)
    run_all(calls)
    lines = spans_logged_by_then(span_log, offset, count=len(contents))
    mine = {line["content"]: line for line in lines if line["content"] in contents}
    assert set(mine) == set(contents), lines
    most = region_forwards_at_most(server)
    for content, line in mine.items():
        i = int(content.split()[0])
        assert line["value"] == str(i * 7 + i) and line["waited_ms"] == 0, line
        assert 1 <= line["forwards"] <= most, line


@pytest.mark.one_rank
def test_stall_benchmark_runs(server: SglangServer, server_daemon: Daemon) -> None:
    """The stall benchmark's measurement on the session server, every arm (its numbers are not
    checked). The benchmark is the lab's: checked here, where the session's server is, when it
    is installed."""
    pytest.importorskip("evald_lab", reason=LAB_NEEDED)
    from evald_lab.bench.sglang_stall import ARMS, measure_stall

    result = measure_stall(
        server, server_daemon.target, rounds=1, plain=2, evaluated=2, max_tokens=12,
        daemon_pid=server_daemon.pid,
    )  # fmt: skip
    assert tuple(result["arms"]) == ARMS
    assert set(result["overlapped_share"]) == set(ARMS)
    assert all(0 <= share <= 1 for share in result["overlapped_share"].values())
    for name, arm in result["arms"].items():
        assert 0 < arm["median_gap_ms"] <= arm["p99_gap_ms"] <= arm["max_gap_ms"], (name, arm)
        assert name == "fast" or arm["longest_ratio"] > 0
    texts = result["sample_texts"]
    assert texts["spinning"][0].count("<result_error>deadline_exceeded</result_error>") == 2
    assert texts["stopped"][0].count("<result_error>deadline_exceeded</result_error>") == 2
    assert texts["slow"][0].count("<result_error>deadline_exceeded</result_error>") == 2
    assert texts["apart"][0].count("{deadline_exceeded}") == 2
    assert "<result>42</result>" in texts["fast"][0]
    for name, arm in result["arms"].items():  # the first gap is the wait for the first token
        waits = (arm["first_token_median_ms"], arm["first_token_max_ms"])
        assert 0 < waits[0] <= waits[1] <= arm["max_gap_ms"], (name, arm)


# ---------------------------------------------------------------------- tenant evaluators


def register_secret(daemon: Daemon) -> Any:
    """Registers, for the sglang tenant only, an evaluator ``secret`` that echoes its input;
    returns its spec (as that tenant lists it)."""
    from engine_adapter import list_evaluators
    from evald.testing import guest, manifest_bytes

    module = guest(
        "echo",
        manifest=manifest_bytes(name="secret", tag="secret", semantics_version="secret/1"),
    )
    with Client(daemon.target, TOKEN) as client:
        client.register(module, replace=True)
    return {s.name: s for s in list_evaluators(daemon.target, TOKEN)}["secret"]


def register_spinner(daemon: Daemon, token: str = SPIN_TOKEN) -> Any:
    """Registers, for ``token``'s tenant (the spin tenant's by default), an evaluator ``spin``
    that loops until its deadline."""
    from engine_adapter import list_evaluators
    from evald.testing import named_guest

    with Client(daemon.target, token) as client:
        client.register(named_guest("loop", "spin"), replace=True)
    return {s.name: s for s in list_evaluators(daemon.target, token)}["spin"]


@pytest.mark.one_rank
def test_jump_benchmark_runs(server: SglangServer, server_daemon: Daemon) -> None:
    """The forwards-and-latency benchmark's measurement on the session server (numbers not
    checked, but the stream must show each region arriving); the lab's, when it is installed."""
    pytest.importorskip("evald_lab", reason=LAB_NEEDED)
    from evald_lab.bench.sglang_jump import measure

    result = measure(server, server_daemon.target, alone=1, at_once=2)
    assert result["alone"]["value"]["forwards_median"] >= 1
    assert result["concurrent"]["error"]["latency_ms_median"] > 0


@pytest.mark.one_rank
def test_cost_benchmark_rounds_run(server: SglangServer, server_specs: Any) -> None:
    """The cost benchmark's two kinds of round on the session server (numbers not checked);
    the lab's, when it is installed."""
    pytest.importorskip("evald_lab", reason=LAB_NEEDED)
    from evald_lab.bench.sglang_cost import plain_round, span_round

    assert plain_round(server, 2, 8) > 0
    calc = server_specs["calc"].binding()
    parts: list[Any] = ["So "]
    for i in range(4):
        parts += [(calc, f"{i} + {i}"), ", "]
    result = span_round(server, fixed_tag(*parts[:-1], "."), 1)
    assert result["latency_ms"] > 0 and result["requests_per_s"] > 0
