"""The evaluator manifest (docs/abi.md, Manifest): its fields and the rules each must follow.

One parser for everyone who reads an evaluator's self-description: the host checks the
``evald.manifest`` custom section of every module it loads with :func:`parse_manifest`, and
``evald build`` and clients read the same :class:`Manifest`. A refusal is an
:class:`~evald.contract.EvaldError` with ``invalid_module`` that names the field and the rule.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final

from evald.contract._abi import ABI_VERSION
from evald.contract._alphabet import check_no_angle_bracket
from evald.contract._errors import ErrorCode, EvaldError
from evald.contract._grammar_shape import check_grammar_shape
from evald.contract._manifest_schemas import SCHEMA_FIELDS, parse_schema, schema_text

__all__ = [
    "LITERAL_KINDS",
    "MANIFEST_MAX_BYTES",
    "MAX_EXAMPLES",
    "MAX_LITERAL_RULES",
    "Manifest",
    "parse_manifest",
]

MANIFEST_MAX_BYTES: Final = 64 * 1024
_IDENT = re.compile(r"[a-z][a-z0-9_]{0,31}")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
_SEMANTICS = re.compile(r"[a-z][a-z0-9_]{0,31}/(0|[1-9][0-9]*)")
_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)
_FIELDS: Final = (
    "abi",
    "name",
    "version",
    "tag",
    "semantics_version",
    "description",
    "input_grammar",
    "result_regex",
)
#: Optional manifest fields (docs/abi.md): ``examples``, a few ``{"question", "input", "value"}``
#: objects that request helpers render into model-facing instructions; ``literals``, the input
#: grammar's rules whose strings are literals (numbers, strings) a request may narrow to those
#: of its text; ``input_schema`` and ``result_schema``, the JSON Schemas of a policy's input and
#: values (:mod:`evald.contract._manifest_schemas`).
_OPTIONAL_FIELDS: Final = ("examples", "literals", *SCHEMA_FIELDS)
_EXAMPLE_KEYS: Final = ("question", "input", "value")
MAX_EXAMPLES: Final = 8
#: The kinds of literal a manifest may declare (docs/abi.md, Manifest): how the engine adapter
#: finds a rule's literals in a request's text. ``number``: numerals and number words, written in
#: digits; ``string``: words and quoted phrases, as a double-quoted string with JSON escapes;
#: ``token``: whitespace-separated pieces of the text as written (dates, ISBNs).
LITERAL_KINDS: Final = ("number", "string", "token")
MAX_LITERAL_RULES: Final = 16
_RULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class Manifest:
    """An evaluator's self-description, from its ``evald.manifest`` custom section."""

    abi: int
    name: str
    version: str
    tag: str
    semantics_version: str
    description: str
    input_grammar: str
    result_regex: str
    examples: tuple[dict[str, str], ...] = field(default=(), hash=False)
    """Each ``{"input", "value"}`` plus an optional ``question``: the span content, the value
    the evaluator gives it, and a request it answers."""
    literals: dict[str, str] = field(default_factory=dict, hash=False)
    """Input-grammar rule name → literal kind (one of :data:`LITERAL_KINDS`): the rules whose
    strings are literals, which a request may narrow to the literals of its text."""
    input_schema: dict[str, Any] | None = field(default=None, hash=False)
    """The JSON Schema of the one JSON value the evaluator reads (a policy), or ``None``."""
    result_schema: dict[str, Any] | None = field(default=None, hash=False)
    """The JSON Schema every value the evaluator returns validates against, or ``None``."""

    def schema_texts(self) -> dict[str, str]:
        """``input_schema`` and ``result_schema`` as compact JSON text (``""`` for none), as
        ``EvaluatorInfo`` carries them."""
        return {name: schema_text(getattr(self, name)) for name in SCHEMA_FIELDS}

    def to_json(self) -> dict[str, Any]:
        """The manifest as the JSON object of the custom section."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _FIELDS}
        if self.examples:
            out["examples"] = [dict(example) for example in self.examples]
        if self.literals:
            out["literals"] = dict(self.literals)
        for name in SCHEMA_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def _refuse(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_MODULE, message)


def parse_manifest(payload: bytes) -> Manifest:
    """Parses and checks the payload of an ``evald.manifest`` section (docs/abi.md, Manifest).

    The grammar and regex are checked for shape only (no ``<``, nesting within
    :data:`~evald.contract.MAX_GRAMMAR_NESTING`: the one check the daemon and ``evald build``
    both apply); :func:`check_manifest_grammars` compiles them with XGrammar where installed.

    Raises:
        EvaldError: ``INVALID_MODULE`` naming the first field that breaks its rule.
    """
    if len(payload) > MANIFEST_MAX_BYTES:
        raise _refuse(
            f"the manifest is {len(payload)} bytes; at most {MANIFEST_MAX_BYTES} "
            "bytes are allowed (shorten the grammar or description)"
        )
    try:
        data = json.loads(payload.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _refuse(
            f"the manifest is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from exc
    except json.JSONDecodeError as exc:
        raise _refuse(
            f"the manifest is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    if not isinstance(data, dict):
        raise _refuse("the manifest must be a JSON object")
    missing = [name for name in _FIELDS if name not in data]
    if missing:
        raise _refuse(f"the manifest lacks the field(s) {', '.join(missing)}")
    unknown = sorted(set(data) - set(_FIELDS) - set(_OPTIONAL_FIELDS))
    if unknown:
        raise _refuse(
            f"the manifest has unknown field(s) {', '.join(unknown)}; the ABI v1 "
            f"fields are {', '.join(_FIELDS)} and optionally {', '.join(_OPTIONAL_FIELDS)}"
        )
    abi = data["abi"]
    if type(abi) is not int or abi != ABI_VERSION:
        raise _refuse(f"manifest field abi is {abi!r}; this daemon speaks ABI {ABI_VERSION}")
    for name in _FIELDS[1:]:
        if not isinstance(data[name], str):
            raise _refuse(
                f"manifest field {name} must be a string, not {type(data[name]).__name__}"
            )
    for name in ("name", "tag"):
        if not _IDENT.fullmatch(data[name]):
            raise _refuse(
                f"manifest field {name} is {data[name]!r}; it must match "
                "[a-z][a-z0-9_]{0,31} (lower-case letter, then up to 31 lower-case "
                "letters, digits or underscores)"
            )
    if not _SEMVER.fullmatch(data["version"]):
        raise _refuse(
            f"manifest field version is {data['version']!r}; it must be a semantic "
            "version MAJOR.MINOR.PATCH such as 1.0.0"
        )
    if not _SEMANTICS.fullmatch(data["semantics_version"]):
        raise _refuse(
            f"manifest field semantics_version is {data['semantics_version']!r}; it "
            "must be NAME/N such as calc/1"
        )
    if "\n" in data["description"] or "\r" in data["description"]:
        raise _refuse("manifest field description must be one line")
    if not _ROOT_RULE.search(data["input_grammar"]):
        raise _refuse(
            "manifest field input_grammar must be XGrammar EBNF with a root rule "
            "(a line starting with `root ::=`)"
        )
    if not data["result_regex"]:
        raise _refuse("manifest field result_regex must not be empty")
    check_no_angle_bracket(data["input_grammar"], data["result_regex"])
    check_grammar_shape(data["input_grammar"], data["result_regex"])
    examples = _parse_examples(data.get("examples", []))
    literals = _parse_literals(data.get("literals", {}), data["input_grammar"])
    input_schema, result_schema = (parse_schema(name, data.get(name)) for name in SCHEMA_FIELDS)
    return Manifest(
        **{name: data[name] for name in _FIELDS}, examples=examples, literals=literals,
        input_schema=input_schema, result_schema=result_schema,
    )  # fmt: skip


def _parse_literals(raw: Any, grammar: str) -> dict[str, str]:
    """The optional ``literals``: rules of the input grammar, each with a known kind.

    The rule must be defined in the grammar (a line ``NAME ::= …``); that it compiles as a
    grammar root is checked with XGrammar where installed (``evald build``).
    """
    if not isinstance(raw, dict) or len(raw) > MAX_LITERAL_RULES:
        raise _refuse(
            f"manifest field literals must be an object of at most {MAX_LITERAL_RULES} "
            'rule: kind pairs, such as {"number": "number"}'
        )
    out: dict[str, str] = {}
    for rule, kind in raw.items():
        if not _RULE_NAME.fullmatch(rule):
            raise _refuse(f"manifest literals: {rule!r} is not a grammar rule name")
        if not re.search(rf"^\s*{re.escape(rule)}\s*::=", grammar, re.MULTILINE):
            raise _refuse(
                f"manifest literals names the rule {rule!r}, which input_grammar does not "
                f"define (a line starting with `{rule} ::=`)"
            )
        if kind not in LITERAL_KINDS:
            raise _refuse(
                f"manifest literals[{rule!r}] is {kind!r}; the literal kinds are "
                f"{', '.join(LITERAL_KINDS)}"
            )
        out[rule] = kind
    return out


def _parse_examples(raw: Any) -> tuple[dict[str, str], ...]:
    """The optional ``examples``: at most :data:`MAX_EXAMPLES` one-line string objects."""
    if not isinstance(raw, list) or len(raw) > MAX_EXAMPLES:
        raise _refuse(f"manifest field examples must be a list of at most {MAX_EXAMPLES} objects")
    out = []
    for i, example in enumerate(raw):
        if not isinstance(example, dict) or not {"input", "value"} <= set(example):
            raise _refuse(f"manifest examples[{i}] must be an object with input and value")
        extra = sorted(set(example) - set(_EXAMPLE_KEYS))
        if extra:
            raise _refuse(f"manifest examples[{i}] has unknown key(s) {', '.join(extra)}")
        for key, value in example.items():
            if not isinstance(value, str) or not value or "\n" in value or "\r" in value:
                raise _refuse(f"manifest examples[{i}].{key} must be a non-empty one-line string")
        out.append({key: example[key] for key in _EXAMPLE_KEYS if key in example})
    return tuple(out)
