"""Computed properties in a JSON schema: read, checked and lowered before generation.

A property marked ``"computed": {"by": EVALUATOR, "from": POINTERS}`` is written by the engine:
when generation reaches its value, the evaluator is called with the values already written at
``from`` and its answer is forced (docs/computed-fields.md). This module turns a request's
schema into what generation needs:

- the **lowered schema**: the request's schema without the adapter's keywords, each computed
  property made required and allowed to hold the error object ``{"$error": CODE}`` in place of
  its value, and each ``extracted`` property narrowed to the literals of the request's text;
- its **grammar** (XGrammar EBNF, compact separators ``", "`` and ``": "``, so the text between
  two properties is fixed and can be forced);
- the **plan** (:class:`ComputedPlan`): per computed property its evaluator, its inputs and its
  declared schema, and per object on the way to one the order of its properties.

Everything a request can get wrong is refused here, before generation, with a JSON pointer into
the request's schema (:class:`ComputedSchemaError`): an unknown evaluator, a pointer to nothing
or to a later property, a cycle, a computed property where the text's structure cannot tell
when its value is due (inside an array, a union, a reference), a declared schema that cannot
accept what the evaluator returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COMPUTED_KEYWORD",
    "EXTRACTED_KEYWORD",
    "ComputedField",
    "ComputedPlan",
    "ComputedSchemaError",
    "contains_computed",
    "json_pointer",
    "parse_pointer",
]

#: The keyword that marks a computed property: ``{"by": EVALUATOR, "from": POINTERS}``.
COMPUTED_KEYWORD = "computed"
#: The keyword that narrows a property to the literals of the request's text.
EXTRACTED_KEYWORD = "extracted"
_COMPUTED_KEYS = frozenset({"by", "from"})
# Schema keywords under which a computed property's value could not be told apart by the text's
# structure alone (the tracker follows objects reached through ``properties`` only).
_OPAQUE = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
           "additionalProperties", "patternProperties", "$defs", "definitions",
           "dependentSchemas", "contains", "unevaluatedProperties")  # fmt: skip
#: Largest schema (its JSON) the adapter lowers: the grammar is compiled per request.
MAX_SCHEMA_BYTES = 256 * 1024


class ComputedSchemaError(ValueError):
    """A schema the adapter refuses. ``path`` is a JSON pointer into the request's schema."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or '/'}: {message}")
        self.path = path or "/"
        self.message = message


@dataclass(frozen=True)
class ComputedField:
    """One computed property: where it is, who computes it, from what."""

    path: tuple[str, ...]
    """The property's place in the document (object keys from the root)."""
    evaluator: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]
    """``(name, path)`` per input; ``name`` is empty for the single-pointer form."""
    form: str
    """``value`` (one pointer: a string passes its text, anything else its JSON), ``object``
    or ``array`` (the inputs as one compact JSON object or array)."""
    schema: Mapping[str, Any]
    """The property's declared schema, without the adapter's keywords."""
    delimiter: str = ""
    """Forced right after a number value, which the next character would otherwise extend
    (``,`` when a required property follows, ``}`` when it ends its object)."""
    input_schema: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def pointer(self) -> str:
        return json_pointer(self.path)

    @property
    def key(self) -> str:
        return self.path[-1]


@dataclass(frozen=True)
class ComputedPlan:
    """What generation needs to compute a request's properties."""

    fields: tuple[ComputedField, ...]
    objects: Mapping[tuple[str, ...], tuple[str, ...]]
    """Per object on the way to a computed property (its path), its properties in order."""
    schema: Mapping[str, Any] = field(compare=False)
    """The lowered schema (the request's, plus the error alternative)."""
    ebnf: str = field(default="", compare=False)

    def field_at(self, path: tuple[str, ...]) -> int | None:
        """The index of the computed property at ``path``, or None."""
        for index, computed in enumerate(self.fields):
            if computed.path == path:
                return index
        return None


def contains_computed(schema: Any) -> bool:
    """Whether a JSON schema (dict or JSON text) holds a ``computed`` property anywhere.

    Engines call this to decide whether a request needs a computed-fields state at all.
    """
    if isinstance(schema, str | bytes):
        try:
            schema = json.loads(schema)
        except ValueError:
            return False
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            properties = node.get("properties")
            if isinstance(properties, Mapping):
                for child in properties.values():
                    if isinstance(child, Mapping) and COMPUTED_KEYWORD in child:
                        return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def json_pointer(path: Sequence[str]) -> str:
    """The RFC 6901 pointer of a path of object keys (``("a", "b/c")`` → ``/a/b~1c``)."""
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in path)


def parse_pointer(pointer: str) -> tuple[str, ...]:
    """An RFC 6901 JSON pointer's reference tokens. Raises ValueError when malformed."""
    if pointer == "":
        return ()
    if not pointer.startswith("/"):
        raise ValueError("a JSON pointer starts with '/' (from the document's root)")
    parts = pointer[1:].split("/")
    for part in parts:
        if "~" in part.replace("~0", "").replace("~1", ""):
            raise ValueError(f"bad escape in {part!r} (use ~0 for '~' and ~1 for '/')")
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in parts)
