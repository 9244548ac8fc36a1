"""The SGLang plugin (entry point ``evald = engine_adapter.sglang.plugin:register``).

SGLang calls :func:`register` in every one of its processes (``load_plugins()``: the launcher,
the tokenizer and detokenizer managers, and each scheduler, which is started with *spawn*, so
monkeypatches made in a parent would not carry over). It registers hooks with SGLang's
``HookRegistry``, which applies them right after all plugins ran:

- AFTER ``XGrammarGrammarBackend.__init__``: builds the backend's :class:`AdapterRuntime` (the
  tokenizer's codec from the ``TokenizerInfo`` SGLang just built, the evald address).
- AROUND ``XGrammarGrammarBackend.dispatch_structural_tag``: when the request's tag holds
  evaluated spans (``evaluated_tag`` elements, or their lowered form), compiles the lowered tag
  and wraps the grammar in an :class:`EvaluatorGrammar`. The backend stays ``xgrammar``, so
  SGLang's reasoning-parser wrapping and its grammar cache keep working.
- AFTER ``XGrammarGrammarBackend.compile_framed_grammar``: keeps the wrapper when a reasoning
  parser frames the grammar.
- BEFORE ``create_grammar_backend`` (in each scheduler, with the resolved server arguments) and
  BEFORE ``ServerArgs.resolve_once`` (in the launching process, on the declared arguments):
  refuse what v1 does not support.

``HookRegistry`` only logs a hook it fails to apply, and swallows exceptions raised by a plugin,
so the adapter checks for itself: :func:`register` resolves every target first and exits the
process with a clear message if one is missing, and the first hook that runs in a process checks
that every hook is in place (:func:`verify_installed`) and fails that process loudly if not.

Off unless ``EVALD_TARGET`` is set (see :class:`~engine_adapter.sglang.AdapterConfig`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import pkgutil
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from engine_adapter._server_config import AdapterConfig, ConfigError

__all__ = [
    "SGLANG_VERSION",
    "PluginError",
    "UnsupportedConfiguration",
    "check_server_args",
    "hooks",
    "register",
    "verify_installed",
]

logger = logging.getLogger("engine_adapter.sglang")

#: The SGLang release whose internals (call order, hook targets) the adapter was written against.
SGLANG_VERSION = "0.5.23"

_BACKEND = "sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend"
_RUNTIME_ATTR = "_evald_runtime"


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
    missing = [target for target, _, _ in hooks() if not _resolves(target)]
    if missing:
        raise SystemExit(
            "evald SGLang adapter: this SGLang lacks hook targets "
            f"{', '.join(missing)}; the adapter was written against sglang=={SGLANG_VERSION}. "
            "Install that version, or unset EVALD_TARGET to run without the adapter."
        )
    for target, hook, kind in hooks():
        HookRegistry.register(target, hook, kind)
    logger.info(
        "evald SGLang adapter: hooks registered (spans evaluated by %s, deadline %d ms)",
        config.target,
        config.deadline_ms,
    )


def hooks() -> Iterator[tuple[str, Callable[..., Any], Any]]:
    """``(target, hook, HookType)`` for every hook the adapter installs."""
    from sglang.srt.plugins.hook_registry import HookType

    yield f"{_BACKEND}.__init__", _after_backend_init, HookType.AFTER
    yield f"{_BACKEND}.dispatch_structural_tag", _around_dispatch_structural_tag, HookType.AROUND
    yield f"{_BACKEND}.compile_framed_grammar", _after_compile_framed_grammar, HookType.AFTER
    yield (
        "sglang.srt.constrained.base_grammar_backend.create_grammar_backend",
        _before_create_grammar_backend,
        HookType.BEFORE,
    )
    # ServerArgs is a msgspec Struct, which calls the __post_init__ it was built with, so a hook
    # there never runs; launchers call resolve_once() on the declared arguments instead.
    yield "sglang.srt.server_args.ServerArgs.resolve_once", _before_resolve, HookType.BEFORE


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
        UnsupportedConfiguration: speculative decoding, TP > 1, PP > 1, or a grammar backend
            other than xgrammar (the message says what to change).
    """
    problems = []
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm is not None and str(getattr(algorithm, "name", algorithm)).upper() not in (
        "",
        "NONE",
    ):
        problems.append(
            f"speculative decoding (--speculative-algorithm {algorithm}): drafted tokens are "
            "verified without the adapter's forced tokens; start without it"
        )
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    if tp_size > 1:
        problems.append(
            f"--tp-size {tp_size}: every TP rank runs the grammar and would decide a span's "
            "timeout on its own, so ranks could force different tokens; use --tp-size 1 and "
            "scale out with --dp-size or more servers behind the router"
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
    from engine_adapter._server_runtime import AdapterRuntime

    codec = _codec(tokenizer, backend._tokenizer_info)
    setattr(backend, _RUNTIME_ATTR, AdapterRuntime(config, codec))


def _around_dispatch_structural_tag(original: Any, backend: Any, key_string: str) -> Any:
    runtime = getattr(backend, _RUNTIME_ATTR, None)
    if runtime is None:
        return original(backend, key_string)
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    from engine_adapter._evaluated_tag import EvaluatedTagError
    from engine_adapter._lowered_spans import plan_spans
    from engine_adapter.sglang._grammar_object import EvaluatorGrammar

    try:
        plan = plan_spans(key_string, runtime.evaluators)
    except EvaluatedTagError as exc:
        logger.error("evald adapter: invalid evaluated structural tag: %s", exc)
        return InvalidGrammarObject(f"evaluated structural tag: {exc}")
    if plan is None:
        return original(backend, key_string)
    grammar = original(backend, plan.key_string)
    if isinstance(grammar, InvalidGrammarObject):
        return grammar
    return EvaluatorGrammar(grammar, plan.bindings, runtime)


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
        return EvaluatorGrammar(result, grammar.bindings, grammar.runtime)
    return None


# ---------------------------------------------------------------------- helpers

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
    from engine_adapter._injector import TokenCodec

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
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != SGLANG_VERSION:
        logger.warning(
            "evald SGLang adapter: written against sglang==%s, running on %s; hooks are "
            "checked at start-up, but the grammar call order is only known for %s",
            SGLANG_VERSION,
            version,
            SGLANG_VERSION,
        )
