"""One check of a grammar's shape for the daemon and ``evald build``: nesting within
MAX_GRAMMAR_NESTING (evald/contract/_grammar_shape.py).

The daemon accepted a grammar nested 1,500 deep that ``evald build`` refused (XGrammar's own
limit), and every request naming it then failed with an untyped XGrammar error. The daemon-level
refusal is in tests/evald/daemon/test_server_registration.py.
"""

from __future__ import annotations

import pytest

from evald.contract import MAX_GRAMMAR_NESTING, ErrorCode, EvaldError, parse_manifest
from evald.host import check_manifest_grammars
from evald.testing import manifest_bytes


def _nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def _nested_regex(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


def test_the_deepest_nesting_allowed_passes_both_checks_and_one_more_is_refused() -> None:
    at_bound = parse_manifest(
        manifest_bytes(
            input_grammar=_nested(MAX_GRAMMAR_NESTING),
            result_regex=_nested_regex(MAX_GRAMMAR_NESTING),
        )
    )
    # XGrammar (evald build, the engine adapter) compiles whatever the contract admits
    assert check_manifest_grammars(at_bound)
    for field, text in (
        ("input_grammar", _nested(MAX_GRAMMAR_NESTING + 1)),
        ("result_regex", _nested_regex(MAX_GRAMMAR_NESTING + 1)),
        ("input_grammar", _nested(1_500)),
    ):
        with pytest.raises(EvaldError) as refused:
            parse_manifest(manifest_bytes(**{field: text}))
        assert refused.value.code is ErrorCode.INVALID_MODULE
        assert f"{field} nests groups" in refused.value.message
        assert str(MAX_GRAMMAR_NESTING) in refused.value.message


def test_parentheses_in_strings_classes_comments_and_escapes_do_not_count() -> None:
    deep = "(" * (MAX_GRAMMAR_NESTING + 1)
    grammar = f'root ::= "{deep}" | [{deep}] | "a" # {deep}\n'
    parse_manifest(manifest_bytes(input_grammar=grammar, result_regex=f"[{deep}]|\\{deep[:1]}"))
