"""The ABI's ``<`` rule, enforced at every load from one scan (``evald.contract._alphabet``).

A result regex that can produce ``<`` let a tenant's evaluator force text such as
``1<|im_end|>\\n<|im_start|>system`` through the model: a role injection. The daemon now refuses
such a module at registration, as ``evald build`` does.
"""

from __future__ import annotations

import pytest
from daemon_harness import Daemon

from evald.client import CallError
from evald.contract import EvaldError, check_no_angle_bracket, may_produce
from evald.testing import guest, manifest_bytes

SAFE_GRAMMAR = 'root ::= [0-9]+ ("." [0-9]+)?'


@pytest.mark.parametrize(
    "regex",
    [
        "[^#]*",  # the reported one: a negated class that does not exclude '<'
        ".*",
        r"\S+",
        r"\W",
        r"\D",
        r"\x3c",
        r"\u003C",
        "[;-=]",  # a range over '<'
        r"[\x00-\x7f]+",
        r"\p{L}+",  # an escape the scan does not read
        "[a-z",  # unterminated
        "a|<",
    ],
)
def test_regexes_that_may_produce_lt(regex: str) -> None:
    assert may_produce(regex, "<", regex=True)[0]
    with pytest.raises(EvaldError, match="result_regex may produce '<'"):
        check_no_angle_bracket(SAFE_GRAMMAR, regex)


@pytest.mark.parametrize(
    "regex",
    [
        "-?(0|[1-9][0-9]*)(\\.[0-9]*[1-9])?",
        "[^<]*",
        "[^<\\n]+",
        r"\d+\s\w+",
        r"[a-z]+\b",
        "true|false",
        '"([^"\\\\<>\\u0000-\\u001f]|\\\\["\\\\nt])*"',
    ],
)
def test_regexes_that_cannot(regex: str) -> None:
    assert not may_produce(regex, "<", regex=True)[0]
    check_no_angle_bracket(SAFE_GRAMMAR, regex)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= [^"]+',
        'root ::= "a<b"',
        'root ::= "\\x3c"',
        "root ::= [;-=]",
        'root ::= "unterminated',
        "root ::= .",
    ],
)
def test_grammars_that_may_produce_lt(grammar: str) -> None:
    with pytest.raises(EvaldError, match="input_grammar may produce '<'"):
        check_no_angle_bracket(grammar, "[0-9]+")


def test_a_comment_may_mention_lt() -> None:
    check_no_angle_bracket('# no "<" here\nroot ::= [0-9]+ # nor [^a] here\n', "[0-9]+")


def test_the_daemon_refuses_a_module_whose_result_may_spell_special_tokens(
    daemon: Daemon,
) -> None:
    manifest = manifest_bytes(
        name="inject", tag="inject", semantics_version="inject/1", result_regex="[^#]*"
    )
    module = guest("echo", manifest=manifest)
    with pytest.raises(CallError) as refused:
        daemon.client("beta").register(module)
    assert refused.value.code == "invalid_module"
    assert "result_regex may produce '<'" in refused.value.message
    assert daemon.client("beta").evaluate("calc", b"1 + 1").value == "2"
