"""Grammar compiles never hold SGLang's compile threads while evald answers for a tenant.

SGLang's real ``XGrammarGrammarBackend`` (its compile pool, hooks installed by SGLang's own
``load_plugins()``) and ``GrammarManager.process_req_with_grammar`` (the hooked method, called
as the scheduler calls it, on an object holding only what the method reads), real evald daemons
over unix sockets; one is stopped (SIGSTOP): connected, never answering.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.constrained.xgrammar_backend",
    reason="SGLang's grammar layer is not installed (pip install --no-deps sglang==0.5.23)",
)

from daemon_harness import Daemon, start_daemon
from sglang_harness import CALC_ONLY_TOKEN, CONFIG, TOKEN, environment

from engine_adapter.serving._server_config import AdapterConfig
from engine_adapter.serving._server_runtime import AdapterRuntime
from engine_adapter.sglang import EvaluatorGrammar, structural_tag_for
from engine_adapter.sglang._compile_gate import GatedExecutor
from engine_adapter.testing import SilentAddress, stopped

pytestmark = pytest.mark.sglang


# ---------------------------------------------------------------------- the gate itself


def test_a_gated_compile_starts_only_once_the_gate_is_done() -> None:
    ran = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gated = GatedExecutor(pool)
        gate: concurrent.futures.Future[None] = concurrent.futures.Future()
        with gated.after(gate):
            later = gated.submit(lambda x: (ran.set(), x * 2)[1], 21)
        now = gated.submit(lambda: "at once")  # outside the block: no gate
        assert now.result(timeout=10) == "at once"
        assert not later.done() and not ran.is_set()
        gate.set_result(None)
        assert later.result(timeout=10) == 42


def test_a_cancelled_gated_compile_never_runs_and_errors_reach_the_future() -> None:
    ran = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gated = GatedExecutor(pool)
        gate: concurrent.futures.Future[None] = concurrent.futures.Future()
        with gated.after(gate):
            dropped = gated.submit(ran.set)
            failing = gated.submit(lambda: 1 / 0)
        assert dropped.cancel()  # what SGLang does when a grammar times out
        gate.set_result(None)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=10)
    assert not ran.is_set()


# ---------------------------------------------------------------------- SGLang's grammar layer


@pytest.fixture
def silent_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """An evald the tests stop: its tenants' tokens are never answered while it is."""
    handle = start_daemon(tmp_path_factory.mktemp("evald-silent"), CONFIG)
    try:
        yield handle
    finally:
        handle.stop()


def request(tag: str, custom_params: dict[str, str]) -> Any:
    """What ``process_req_with_grammar`` reads of a ``Req``, and what it writes."""
    params = SimpleNamespace(
        json_schema=None, regex=None, ebnf=None, structural_tag=tag, custom_params=custom_params
    )
    req = SimpleNamespace(
        sampling_params=params, origin_input_ids=[1, 2, 3], require_reasoning=False,
        grammar=None, grammar_key=None, aborted=None,
    )  # fmt: skip
    req.set_finish_with_abort = lambda message: setattr(req, "aborted", message)
    return req


def test_a_tenant_evald_does_not_answer_for_holds_no_compile_thread(
    plugins_loaded: None,
    adapter_env: dict[str, str],
    tokenizer: Any,
    daemon: Daemon,
    silent_daemon: Daemon,
) -> None:
    """More new tenants than SGLang has compile threads, all at an evald that does not answer
    (stopped), then a request of the server's own tenant with a tag nobody compiled yet: its
    grammar compiles while every one of theirs still waits for evald's answer about its token.
    Before, each of theirs waited on a compile thread (up to 5 s) and the server's own request
    waited behind them, as did every grammar of every tenant."""
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    with environment(**adapter_env, EVALD_ALLOWED_TARGETS=silent_daemon.target):
        backend = XGrammarGrammarBackend(
            tokenizer, vocab_size=len(tokenizer), model_eos_token_ids=[tokenizer.eos_token_id]
        )
    assert isinstance(backend.executor, GatedExecutor)
    manager = SimpleNamespace(grammar_backend=backend, grammar_queue=[])
    manager._get_request_thinking_budget = lambda req: None
    manager._apply_request_reasoning_config = lambda req: None
    threads = backend.executor.pool._max_workers
    tag = structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="Answer: <calc>")
    strangers = [
        request(json.dumps(tag), {"evald_token": f"stranger-{i:04d}-0123456789abcdef",
                                  "evald_target": silent_daemon.target})
        for i in range(threads + 2)
    ]  # fmt: skip
    own = request(json.dumps({**tag, "note": "a tag not compiled yet"}), {})
    with stopped(silent_daemon.process.pid):
        for req in strangers:
            GrammarManager.process_req_with_grammar(manager, req)
        GrammarManager.process_req_with_grammar(manager, own)
        grammar = own.grammar.result(timeout=120)
        waiting = [req for req in strangers if not req.grammar.done()]
    assert isinstance(grammar, EvaluatorGrammar) and grammar.runtime.refusal is None
    assert len(waiting) == len(strangers), f"{len(strangers) - len(waiting)} compiled first"
    for req in strangers:  # answered once evald is back: the made-up tokens are refused
        stranger = req.grammar.result(timeout=120)
        assert isinstance(stranger, EvaluatorGrammar), stranger
        assert stranger.runtime.refusal is not None
        assert stranger.runtime.refusal[0] in ("permission_denied", "unavailable")
    backend.executor.shutdown(wait=False)


def test_a_new_tenant_compiles_while_a_flood_names_an_address_that_hangs(
    plugins_loaded: None, adapter_env: dict[str, str], tokenizer: Any, daemon: Daemon
) -> None:
    """Requests with new tokens naming an allowed address that accepts and never answers (a
    stand-in for a hung evald, :class:`~engine_adapter.testing.SilentAddress`), before and
    after a new tenant's first request at the real evald: the new tenant's grammar compiles,
    bound to its accepted runtime, while the hung address's first check still waits for its
    connection (given two minutes here, so that only the real check can finish first). Before,
    one thread checked every token, newest first, up to 5 s each, and the new tenant waited
    behind the flood for as long as it lasted."""
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    with SilentAddress() as silent:
        with environment(**adapter_env, EVALD_ALLOWED_TARGETS=silent.target):
            backend = XGrammarGrammarBackend(
                tokenizer, vocab_size=len(tokenizer), model_eos_token_ids=[tokenizer.eos_token_id]
            )
        tenants = backend._evald_tenants
        tenants.connect_timeout_s = 120.0
        manager = SimpleNamespace(grammar_backend=backend, grammar_queue=[])
        manager._get_request_thinking_budget = lambda req: None
        manager._apply_request_reasoning_config = lambda req: None
        tag = json.dumps(structural_tag_for(daemon.target, TOKEN, ["calc"], prefix="<calc>"))
        flood = [
            request(tag, {"evald_token": f"flood-{i:04d}-0123456789abcdef",
                          "evald_target": silent.target})
            for i in range(60)
        ]  # fmt: skip
        newcomer = request(tag, {"evald_token": CALC_ONLY_TOKEN})
        try:
            for req in flood[:30]:
                GrammarManager.process_req_with_grammar(manager, req)
            GrammarManager.process_req_with_grammar(manager, newcomer)
            for req in flood[30:]:  # newer than the new tenant's
                GrammarManager.process_req_with_grammar(manager, req)
            grammar = newcomer.grammar.result(timeout=120)
            assert isinstance(grammar, EvaluatorGrammar)
            assert grammar.runtime.admitted and grammar.runtime.refusal is None
            assert not any(req.grammar.done() for req in flood)
            assert tenants.stats["unreachable"] == 0 and silent.accepted >= 1
        finally:
            tenants.close()  # answers the flood; its grammars compile refused
            backend.executor.shutdown(wait=False)


def test_held_specs_answer_at_once_while_evald_does_not(
    silent_daemon: Daemon, backend: Any
) -> None:
    """A runtime whose evaluator list is older than its TTL answers with it at once and
    re-lists in the background; a compile thread never waits for a stopped evald.

    Every listing the test reads is one evald cannot answer yet (stopped), or one it waited
    for: with a TTL of 0 each ``evaluators()`` call starts a re-listing, and one started
    while evald answers may end at any moment (on a busy machine, between two lines)."""
    base: AdapterRuntime = backend._evald_runtime
    config = AdapterConfig(
        **{**base.config.__dict__, "target": silent_daemon.target, "evaluators_ttl_s": 0.0}
    )
    runtime = AdapterRuntime(config, base.codec)
    with stopped(silent_daemon.process.pid):  # the first listing waits for evald
        listing = runtime.listing_ready()
        assert listing is not None  # nothing held: a listing starts
        assert runtime.listing_ready() is listing and not listing.done()  # one at a time
    listing.result(timeout=30)
    held = [spec.name for spec in runtime.evaluators()]  # TTL 0: also starts a re-listing
    assert "calc" in held and runtime.listing_ready() is None
    started = runtime._listing  # None if that re-listing has ended already
    if started is not None:
        started.result(timeout=30)
    assert runtime._listing is None
    with stopped(silent_daemon.process.pid):
        assert [spec.name for spec in runtime.evaluators()] == held
        relisting = runtime._listing
        assert relisting is not None and not relisting.done()  # asked in the background
    relisting.result(timeout=30)


def test_a_failed_listing_answers_for_the_next_second(silent_daemon: Daemon, backend: Any) -> None:
    """A runtime holding no specs whose listing just failed (evald gone) gates no compile on a
    new listing and answers the failure at once; a second later it asks again."""
    from engine_adapter.serving._server_runtime import LISTING_MEMORY_S
    from engine_adapter.spans._lowered_spans import EvaluatorsUnavailable

    base: AdapterRuntime = backend._evald_runtime
    config = AdapterConfig(**{**base.config.__dict__, "target": silent_daemon.target})
    runtime = AdapterRuntime(config, base.codec)
    silent_daemon.kill()
    listing = runtime.listing_ready()
    assert listing is not None
    listing.result(timeout=30)
    assert runtime.listing_ready() is None and runtime._listing is None
    with pytest.raises(EvaluatorsUnavailable, match="ListEvaluators"):
        runtime.evaluators()
    assert runtime._listing is None  # nothing asked again
    time.sleep(LISTING_MEMORY_S)
    retry = runtime.listing_ready()
    assert retry is not None  # past the memory: a new listing
    retry.result(timeout=30)
