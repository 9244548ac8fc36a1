"""The SGLang plugin (entry point ``evald = engine_adapter.sglang.plugin:register``).

SGLang calls :func:`register` in every one of its processes (``load_plugins()``: the launcher,
the tokenizer and detokenizer managers, and each scheduler, which is started with *spawn*, so
monkeypatches made in a parent would not carry over). It registers hooks with SGLang's
``HookRegistry``, which applies them right after all plugins ran.

The grammar layer:

- AFTER ``XGrammarGrammarBackend.__init__``: builds the backend's
  :class:`~engine_adapter.serving.TenantRuntimes` (the tokenizer's codec from the
  ``TokenizerInfo`` SGLang just built, the server's own tenant).
- AROUND ``GrammarManager.process_req_with_grammar``: takes a request's tenant options out of
  its ``custom_params``, picks its tenant's runtime and keys its grammar by tenant and spec
  revision (:mod:`engine_adapter.sglang._tenants`); a compile that needs evald's answer first
  (a tenant not yet accepted) waits for it off SGLang's compile threads
  (:mod:`engine_adapter.sglang._compile_gate`, installed on the backend's ``executor``).
- AROUND ``XGrammarGrammarBackend.dispatch_structural_tag``: when the request's tag holds
  evaluated spans (``evaluated_tag`` elements, or their lowered form), compiles the lowered tag
  and wraps the grammar in an :class:`EvaluatorGrammar` bound to the request's tenant. The
  backend stays ``xgrammar``, so SGLang's reasoning-parser wrapping and its grammar cache keep
  working.
- AROUND ``XGrammarGrammarBackend.dispatch_json``: a ``json_schema`` (native or the OpenAI API's
  ``response_format``) with computed properties is lowered with the request's tenant's
  evaluators, compiled, and wrapped the same way (:mod:`engine_adapter.sglang._computed_json`);
  any other schema is SGLang's.
- AFTER ``XGrammarGrammarBackend.compile_framed_grammar``: keeps the wrapper when a reasoning
  parser frames the grammar.

The scheduler (:mod:`engine_adapter.sglang._scheduling`): AROUND ``Scheduler.get_next_batch_to_run``
(requests waiting for a value sit out the decode step), ``Scheduler.get_new_batch_prefill`` (they
come back with the whole result region in one extend), ``Scheduler.is_fully_idle`` and
``Scheduler.collect_inflight_reqs`` (parked requests count as running).

The settings: BEFORE ``create_grammar_backend`` (in each scheduler, with the resolved server
arguments) and BEFORE ``ServerArgs.resolve_once`` (in the launching process, on the declared
arguments): refuse what the adapter does not support.

``HookRegistry`` only logs a hook it fails to apply, and swallows exceptions raised by a plugin,
so the adapter checks for itself: :func:`register` resolves every target and every SGLang
internal the hooks read (:func:`check_internals`) and exits the process with a clear message if
one is missing, and the first hook that runs in a process checks that every hook is in place
(:func:`verify_installed`) and fails that process loudly if not.

Off unless ``EVALD_TARGET`` is set (see :class:`~engine_adapter.sglang.AdapterConfig`).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

from engine_adapter.serving import AdapterConfig, ConfigError

__all__ = [
    "SCHEDULING_ENV",
    "SCHEDULING_MODES",
    "SGLANG_VERSION",
    "PluginError",
    "UnsupportedConfiguration",
    "check_internals",
    "check_server_args",
    "hooks",
    "register",
    "scheduler_available",
    "scheduling_mode",
    "verify_installed",
]

logger = logging.getLogger("engine_adapter.sglang")

#: The SGLang release whose internals (call order, hook targets) the adapter was written against.
SGLANG_VERSION = "0.5.23"

_BACKEND = "sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_GRAMMAR_MANAGER = "sglang.srt.constrained.grammar_manager.GrammarManager"
_RUNTIME_ATTR = "_evald_runtime"
_TENANTS_ATTR = "_evald_tenants"

#: How the scheduler handles a request whose span is being evaluated:
#: ``jump`` (default) — it sits out decode steps while the value is pending and comes back with
#: the whole result region in one extend forward; ``inline`` — it stays in the batch and the
#: region is forced one token per decode step, the step waiting when nothing can be forced yet
#: (the adapter before it had scheduler hooks; kept for comparisons).
SCHEDULING_ENV = "EVALD_SGLANG_SCHEDULING"
SCHEDULING_MODES = ("jump", "inline")


class PluginError(RuntimeError):
    """The adapter's hooks are not in place; the message names the missing targets."""


class UnsupportedConfiguration(ValueError):
    """SGLang was started with an option v1 of the adapter cannot run with."""


# ---------------------------------------------------------------------- entry point


def register() -> None:
    """Registers the adapter's hooks (SGLang's plugin entry point); no-op without EVALD_TARGET.

    Raises:
        SystemExit: a bad ``EVALD_*`` setting or a hook target missing from this SGLang. SGLang
            logs and ignores ordinary exceptions from plugins; exiting is the only way to stop
            a process that would otherwise serve without the adapter it was asked to run.
    """
    try:
        config = AdapterConfig.from_env()
    except ConfigError as exc:
        raise SystemExit(f"evald SGLang adapter: {exc}") from None
    if config is None:
        logger.info("evald SGLang adapter: disabled (EVALD_TARGET is not set)")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    _check_version()
    try:
        scheduling_mode()
    except ConfigError as exc:
        raise SystemExit(f"evald SGLang adapter: {exc}") from None
    missing = [target for target, _, _ in hooks() if not _resolves(target)]
    missing += check_internals()
    if missing:
        raise SystemExit(
            "evald SGLang adapter: this SGLang lacks hook targets "
            f"{', '.join(missing)}; the adapter was written against sglang=={SGLANG_VERSION}. "
            "Install that version, or unset EVALD_TARGET to run without the adapter."
        )
    for target, hook, kind in hooks():
        HookRegistry.register(target, hook, kind)
    logger.info(
        "evald SGLang adapter: hooks registered (spans evaluated by %s, deadline %d ms, "
        "scheduling %s)",
        config.target,
        config.deadline_ms,
        scheduling_mode(),
    )


def scheduling_mode(environ: Any = None) -> str:
    """``EVALD_SGLANG_SCHEDULING`` (:data:`SCHEDULING_MODES`; default ``jump``).

    Raises:
        ConfigError: another value.
    """
    import os

    env = os.environ if environ is None else environ
    mode = env.get(SCHEDULING_ENV, "").strip() or SCHEDULING_MODES[0]
    if mode not in SCHEDULING_MODES:
        raise ConfigError(
            f"{SCHEDULING_ENV}={mode!r}: expected one of {', '.join(SCHEDULING_MODES)}"
        )
    return mode


def scheduler_available() -> bool:
    """Whether SGLang's scheduler can be imported here. Every process of a real server can; an
    environment with SGLang's grammar layer alone (``--no-deps``, the project's CPU tests of
    the grammar objects) cannot, and there only the grammar hooks are registered."""
    global _SCHEDULER_AVAILABLE
    if _SCHEDULER_AVAILABLE is None:
        try:
            importlib.import_module(_SCHEDULER.rpartition(".")[0])
        except ImportError:
            _SCHEDULER_AVAILABLE = False
        else:
            _SCHEDULER_AVAILABLE = True
    return _SCHEDULER_AVAILABLE


_SCHEDULER_AVAILABLE: bool | None = None


def check_internals() -> list[str]:
    """The SGLang internals the scheduler hooks rely on that this SGLang lacks (empty: all
    there, or no scheduler in this environment). Attributes set in ``__init__`` (or the
    ``init_*`` helpers it calls) are looked up in their code, properties and methods on the
    class, dataclass and msgspec fields in the class's fields."""
    if not scheduler_available():
        return []
    from engine_adapter.serving import missing_internals
    from engine_adapter.sglang._internals_used import INTERNALS

    return missing_internals(INTERNALS)


def hooks() -> Iterator[tuple[str, Callable[..., Any], Any]]:
    """``(target, hook, HookType)`` for every hook the adapter installs."""
    from sglang.srt.plugins.hook_registry import HookType

    yield f"{_BACKEND}.__init__", _after_backend_init, HookType.AFTER
    yield (
        f"{_GRAMMAR_MANAGER}.process_req_with_grammar",
        _around_process_req_with_grammar,
        HookType.AROUND,
    )
    yield (
        f"{_GRAMMAR_MANAGER}.get_ready_grammar_requests",
        _around_get_ready_grammar_requests,
        HookType.AROUND,
    )
    yield f"{_BACKEND}.dispatch_structural_tag", _around_dispatch_structural_tag, HookType.AROUND
    yield f"{_BACKEND}.dispatch_json", _around_dispatch_json, HookType.AROUND
    yield f"{_BACKEND}.compile_framed_grammar", _after_compile_framed_grammar, HookType.AFTER
    yield (
        "sglang.srt.constrained.base_grammar_backend.create_grammar_backend",
        _before_create_grammar_backend,
        HookType.BEFORE,
    )
    # ServerArgs is a msgspec Struct, which calls the __post_init__ it was built with, so a hook
    # there never runs; launchers call resolve_once() on the declared arguments instead.
    yield "sglang.srt.server_args.ServerArgs.resolve_once", _before_resolve, HookType.BEFORE
    if not scheduler_available():
        return
    yield f"{_SCHEDULER}.get_next_batch_to_run", _around_get_next_batch_to_run, HookType.AROUND
    yield f"{_SCHEDULER}.get_new_batch_prefill", _around_get_new_batch_prefill, HookType.AROUND
    yield f"{_SCHEDULER}.is_fully_idle", _around_is_fully_idle, HookType.AROUND
    yield f"{_SCHEDULER}.collect_inflight_reqs", _around_collect_inflight_reqs, HookType.AROUND


def verify_installed() -> dict[str, bool]:
    """Whether each hook is in the call chain of its target (the patched attribute).

    Returns:
        ``{target: True}`` for every hook.

    Raises:
        PluginError: some hook is not installed (names them); ``HookRegistry`` logged why.
    """
    status = {target: _installed(target, hook) for target, hook, _ in hooks()}
    missing = [target for target, ok in status.items() if not ok]
    if missing:
        raise PluginError(
            "evald SGLang adapter: hooks not installed on "
            f"{', '.join(missing)} (see SGLang's 'Failed to apply hooks' log above); "
            f"the adapter needs sglang=={SGLANG_VERSION} and must be loaded through "
            "sglang.srt.plugins.load_plugins(). Unset EVALD_TARGET to run without it."
        )
    return status


def check_server_args(server_args: Any) -> None:
    """Refuses options v1 cannot run with.

    Raises:
        UnsupportedConfiguration: speculative decoding, PP > 1, ``inline`` scheduling with
            TP > 1, or a grammar backend other than xgrammar (the message says what to change).
    """
    problems = []
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm is not None and str(getattr(algorithm, "name", algorithm)).upper() not in (
        "",
        "NONE",
    ):
        problems.append(
            f"speculative decoding (--speculative-algorithm {algorithm}): the draft model "
            "proposes the tokens after a span's close and the target model verifies them, so "
            "a result region would be accepted from the model instead of forced from evald; "
            "start without --speculative-algorithm and the --speculative-* options that go "
            "with it (for a model whose launch recipe turns EAGLE or MTP on, the same: "
            "docs/sglang.md, 'GPU servers')"
        )
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    if tp_size > 1 and scheduling_mode() == "inline":
        problems.append(
            f"--tp-size {tp_size} with {SCHEDULING_ENV}=inline: inline scheduling waits for a "
            "value inside a step, which tensor-parallel ranks cannot do together; unset "
            f"{SCHEDULING_ENV} (jump scheduling works with any --tp-size)"
        )
    pp_size = int(getattr(server_args, "pp_size", 1) or 1)
    if pp_size > 1:
        problems.append(f"--pp-size {pp_size}: use --pp-size 1")
    backend = getattr(server_args, "grammar_backend", None)
    if backend not in (None, "xgrammar"):
        problems.append(
            f"--grammar-backend {backend}: the adapter needs --grammar-backend xgrammar"
        )
    if problems:
        raise UnsupportedConfiguration(
            "evald SGLang adapter (EVALD_TARGET is set) cannot run with "
            + "; ".join(problems)
            + ". Unset EVALD_TARGET to run SGLang without the adapter."
        )


# ---------------------------------------------------------------------- the hooks


def _before_resolve(server_args: Any, *args: Any, **kwargs: Any) -> None:
    _verify_once()
    check_server_args(server_args)


def _before_create_grammar_backend(server_args: Any, *args: Any, **kwargs: Any) -> None:
    _verify_once()
    check_server_args(server_args)
    resolved = _published_settings()
    if resolved is not None:  # what resolution made of them (a model may turn on drafts)
        check_server_args(resolved)


def _after_backend_init(
    result: Any, backend: Any, tokenizer: Any, *args: Any, **kwargs: Any
) -> None:
    _verify_once()
    config = AdapterConfig.from_env()
    if config is None:
        return
    from engine_adapter.serving import TenantRuntimes
    from engine_adapter.sglang._compile_gate import GatedExecutor

    tenants = TenantRuntimes(config, _codec(tokenizer, backend._tokenizer_info))
    setattr(backend, _RUNTIME_ATTR, tenants.default)
    setattr(backend, _TENANTS_ATTR, tenants)
    backend.executor = GatedExecutor(backend.executor)
    from engine_adapter.sglang._rank_sync import queue_cache_hits, rank_sync

    if rank_sync() is not None:
        queue_cache_hits(backend)


def _around_process_req_with_grammar(original: Any, manager: Any, req: Any) -> Any:
    """Keys the request's grammar by its tenant (see :mod:`engine_adapter.sglang._tenants`)."""
    tenants = getattr(getattr(manager, "grammar_backend", None), _TENANTS_ATTR, None)
    if tenants is None:
        return original(manager, req)
    from engine_adapter.sglang._computed_json import keyed_field
    from engine_adapter.sglang._tenants import REQUEST_ATTR, TENANT_MARK, take_options

    params = req.sampling_params
    options, rest = take_options(getattr(params, "custom_params", None))
    for name in ("structural_tag", "json_schema"):
        text = getattr(params, name, None)
        if isinstance(text, str) and TENANT_MARK in text:
            req.set_finish_with_abort(
                f"evald adapter: the {name.replace('_', ' ')} holds text reserved for the "
                f"adapter ({TENANT_MARK.strip()!r})"
            )
            return False
    if options is not None:
        params.custom_params = rest  # the token leaves the request here
    field = keyed_field(params)  # the structural tag, or a json_schema with computed fields
    if field is None:
        return original(manager, req)
    text = getattr(params, field)
    runtime = tenants.for_request(options).runtime
    mark, keyed = _tenant_keys().key(runtime, options)
    setattr(req, REQUEST_ATTR, keyed)  # lives as long as the request
    setattr(params, field, text + TENANT_MARK + mark)
    try:
        # A compile that would wait for evald's answer waits off SGLang's compile threads.
        with manager.grammar_backend.executor.after(runtime.listing_ready()):
            return original(manager, req)
    finally:
        setattr(params, field, text)


def _around_get_ready_grammar_requests(
    original: Any, manager: Any, *args: Any, **kwargs: Any
) -> Any:
    """With tensor parallelism, a request whose grammar one rank refused is refused on every
    rank (:func:`~engine_adapter.sglang._rank_sync.agree_on_compiles`)."""
    reqs = original(manager, *args, **kwargs)
    if getattr(getattr(manager, "grammar_backend", None), _TENANTS_ATTR, None) is not None:
        from engine_adapter.sglang._rank_sync import agree_on_compiles

        agree_on_compiles(manager, reqs)
    return reqs


def _around_dispatch_structural_tag(original: Any, backend: Any, key_string: str) -> Any:
    default = getattr(backend, _RUNTIME_ATTR, None)
    if default is None:
        return original(backend, key_string)
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    from engine_adapter.serving import needs_lowering
    from engine_adapter.sglang._computed_json import COMPUTED_IN_TAG
    from engine_adapter.sglang._grammar_object import EvaluatorGrammar
    from engine_adapter.sglang._tenants import split_key
    from engine_adapter.spans import EvaluatedTagError, plan_spans

    key_string, mark = split_key(key_string)
    keyed = _tenant_keys().find(mark) if mark is not None else None
    if mark is not None and keyed is None:
        return InvalidGrammarObject(
            "evald adapter: the request this grammar was for has ended; send it again"
        )
    if needs_lowering(key_string):  # never compiled with the keyword silently ignored
        return InvalidGrammarObject(COMPUTED_IN_TAG)
    tenant = keyed.runtime if keyed is not None else default
    try:
        plan = plan_spans(key_string, tenant.evaluators)
    except EvaluatedTagError as exc:
        logger.error("evald adapter: invalid evaluated structural tag: %s", exc)
        return InvalidGrammarObject(f"evaluated structural tag: {exc}")
    if plan is None:
        return original(backend, key_string)
    grammar = original(backend, plan.key_string)
    if isinstance(grammar, InvalidGrammarObject):
        return grammar
    bindings = keyed.bindings(plan.bindings) if keyed is not None else plan.bindings
    return EvaluatorGrammar(grammar, bindings, tenant)


def _around_dispatch_json(original: Any, backend: Any, key_string: str) -> Any:
    default = getattr(backend, _RUNTIME_ATTR, None)
    if default is None:
        return original(backend, key_string)
    from engine_adapter.sglang._computed_json import dispatch_computed_json

    return dispatch_computed_json(original, backend, key_string, default, _tenant_keys())


def _after_compile_framed_grammar(
    result: Any, backend: Any, grammar: Any, *args: Any, **kwargs: Any
) -> Any:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    from engine_adapter.sglang._grammar_object import EvaluatorGrammar

    if (
        isinstance(grammar, EvaluatorGrammar)
        and result is not None
        and not isinstance(result, EvaluatorGrammar | InvalidGrammarObject)
    ):
        return EvaluatorGrammar(result, grammar.bindings, grammar.runtime, grammar.computed)
    return None


def _around_get_next_batch_to_run(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    state = _span_scheduler(scheduler)
    if state is None:
        return original(scheduler, *args, **kwargs)
    running = kwargs.get("running_batch", args[0] if args else scheduler.running_batch)
    started = time.perf_counter_ns()
    # Tensor parallelism: every rank takes the same outcomes now. Not caught: a failed or
    # diverged exchange must stop the scheduler (the ranks cannot agree any more).
    state.exchange()
    try:
        state.sit_out(scheduler, running)
    except Exception:  # the adapter must never take the scheduler down
        logger.exception("evald adapter: taking waiting requests out of the batch failed")
    spent = time.perf_counter_ns() - started
    plan = original(scheduler, *args, **kwargs)  # its prefill hook adds its own time
    state.count_step(spent)
    if plan.batch_to_run is None:
        try:
            state.wait_if_idle(scheduler, plan.running_batch)
        except Exception:
            logger.exception("evald adapter: waiting for pending evaluations failed")
    return plan


def _around_get_new_batch_prefill(original: Any, scheduler: Any, running_batch: Any) -> Any:
    state = _span_scheduler(scheduler)
    if state is not None:
        started = time.perf_counter_ns()
        try:
            rejoin = state.rejoin_batch(scheduler, running_batch)
        except Exception:
            logger.exception("evald adapter: bringing requests back failed")
            rejoin = None
        state.stats.hook_ns += time.perf_counter_ns() - started
        if rejoin is not None:
            from sglang.srt.managers.schedule_batch import NextBatchPlan

            batch, running_batch = rejoin
            return NextBatchPlan(batch_to_run=batch, running_batch=running_batch)
    return original(scheduler, running_batch)


def _around_is_fully_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    idle = original(scheduler, *args, **kwargs)
    state = _span_scheduler(scheduler)
    if idle and state is not None and state.parked:
        return False  # parked requests hold KV rows: not idle, no leak check
    return idle


def _around_collect_inflight_reqs(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    reqs = original(scheduler, *args, **kwargs)
    state = _span_scheduler(scheduler)
    if state is not None and state.parked:
        reqs = {*reqs, *state.parked}
    return reqs


# ---------------------------------------------------------------------- helpers

_TENANT_KEYS: Any = None
_SCHEDULING: str | None = None


def _tenant_keys() -> Any:
    global _TENANT_KEYS
    if _TENANT_KEYS is None:
        from engine_adapter.sglang._tenants import TenantKeys

        _TENANT_KEYS = TenantKeys()
    return _TENANT_KEYS


def _span_scheduler(scheduler: Any) -> Any:
    """The scheduler's :class:`SpanScheduler`, or ``None`` when the adapter is off or runs
    ``inline`` (checked on first use in each scheduler process)."""
    global _SCHEDULING
    if _SCHEDULING is None:
        _verify_once()
        _SCHEDULING = scheduling_mode() if AdapterConfig.from_env() is not None else "off"
    if _SCHEDULING != "jump":
        return None
    from engine_adapter.sglang._scheduling import scheduler_state

    return scheduler_state(scheduler)


_VERIFIED = False
_VERIFY_LOCK = threading.Lock()


def _verify_once() -> None:
    global _VERIFIED
    with _VERIFY_LOCK:
        if not _VERIFIED:
            verify_installed()
            _VERIFIED = True


def _published_settings() -> Any:
    """The scheduler's resolved settings, or None where none were published (tests)."""
    try:
        from sglang.srt.runtime_context import get_exec, get_parallel, get_spec

        return types.SimpleNamespace(
            speculative_algorithm=get_spec().speculative_algorithm,
            tp_size=get_parallel().tp_size,
            pp_size=get_parallel().pp_size,
            grammar_backend=get_exec().kernel.grammar_backend,
        )
    except Exception:
        return None


def _codec(tokenizer: Any, tokenizer_info: Any) -> Any:
    from engine_adapter.evaluation import TokenCodec

    if hasattr(tokenizer, "init_xgrammar") or not hasattr(tokenizer, "encode"):
        # A tokenizer SGLang special-cases (tiktoken-style): force by the vocabulary alone.
        special = {*tokenizer_info.special_token_ids, *tokenizer_info.stop_token_ids}
        return TokenCodec(tokenizer_info.decoded_vocab, special_ids=special)
    return TokenCodec.from_tokenizer(tokenizer, tokenizer_info=tokenizer_info)


def _split(target: str) -> tuple[str, str]:
    owner, _, attr = target.rpartition(".")
    return owner, attr


def _resolves(target: str) -> bool:
    owner, attr = _split(target)
    try:
        return hasattr(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError, ValueError):
        return False


def _installed(target: str, hook: Callable[..., Any]) -> bool:
    owner, attr = _split(target)
    try:
        function = getattr(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError, ValueError):
        return False
    seen = 0
    while function is not None and seen < 64:  # HookRegistry wrappers keep __wrapped__
        for cell in getattr(function, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        function = getattr(function, "__wrapped__", None)
        seen += 1
    return False


def _check_version() -> None:
    from engine_adapter.serving import warn_if_other_version

    warn_if_other_version(logger, "SGLang", SGLANG_VERSION, ("sglang",))
