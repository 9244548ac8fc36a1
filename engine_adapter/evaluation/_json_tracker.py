"""Follows a JSON document as its bytes are generated, and says when a computed value is due.

The grammar fixes the document's shape, not its content: a string value can hold ``"answer":``
and a nested object can repeat a key, so a computed property is found by structure, never by
searching the text. The tracker is a byte-level JSON lexer with a stack of open containers; the
objects on the way to a computed property (:attr:`ComputedPlan.objects`) are followed by path,
everything else only by depth.

A computed value is **due** at the earliest byte after which the grammar admits nothing but
that property: right after the ``{`` of its object when it comes first, right after the
previous property's value when it comes next in the schema's order (the separator and the key
are then fixed text the engine forces too), or, when an optional property came between, right
after the model wrote its key. The tracker records where every member value of a followed
object lies, so the inputs are read from the text when the value is due.

Its state is a few scalars and tuples: :meth:`snapshot` is O(1) and rollback restores one.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from engine_adapter.spans import ComputedPlan

__all__ = ["Due", "JsonTracker"]

# Lexer states.
_VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _STRING, _KEY_STRING = range(8)
_NUMBER, _LITERAL, _DONE = 8, 9, 10
_SPACE = frozenset(b" \t\r\n")
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_LITERAL_REST = {ord("t"): 3, ord("f"): 4, ord("n"): 3}


class Due(NamedTuple):
    """A computed value is due: force ``prefix`` + value from byte ``anchor`` on."""

    field: int
    anchor: int
    prefix: str
    """The fixed text before the value (``, "answer": ``, ``"answer": `` or ``: ``)."""


class _Frame(NamedTuple):
    is_object: bool
    path: tuple[str, ...] | None
    """The object's path when it is followed (on the way to a computed property)."""
    key: str | None
    start: int


class JsonTracker:
    """One document's structure, fed byte ranges of the text as tokens arrive."""

    def __init__(self, plan: ComputedPlan) -> None:
        self._plan = plan
        self._field_at = {f.path: i for i, f in enumerate(plan.fields)}
        self._objects = plan.objects
        self._state = _VALUE
        self._stack: tuple[_Frame, ...] = ()
        self._token_start = 0
        self._escape = False
        self._literal_left = 0
        self._triggered: frozenset[int] = frozenset()
        self._values: tuple[tuple[tuple[str, ...], int, int], ...] = ()
        self._dues: list[Due] = []

    # ------------------------------------------------------------------ state

    def snapshot(self) -> tuple[Any, ...]:
        return (self._state, self._stack, self._token_start, self._escape,
                self._literal_left, self._triggered, self._values)  # fmt: skip

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        (self._state, self._stack, self._token_start, self._escape,
         self._literal_left, self._triggered, self._values) = snapshot  # fmt: skip

    @property
    def done(self) -> bool:
        """The top-level value is complete."""
        return self._state == _DONE

    def value_span(self, path: tuple[str, ...]) -> tuple[tuple[str, ...], int, int] | None:
        """The recorded member value whose path is the longest prefix of ``path``."""
        best = None
        for recorded in self._values:
            where = recorded[0]
            if path[: len(where)] == where and (best is None or len(where) > len(best[0])):
                best = recorded
        return best

    # ------------------------------------------------------------------ feeding

    def feed(self, text: bytes | bytearray, start: int) -> list[Due]:
        """Reads ``text[start:]``; returns the computed values that became due, in order."""
        self._dues = []
        for i in range(start, len(text)):
            self._byte(text, i, text[i])
        return self._dues

    def _byte(self, text: bytes | bytearray, i: int, c: int) -> None:
        state = self._state
        if state == _STRING or state == _KEY_STRING:
            if self._escape:
                self._escape = False
            elif c == 0x5C:  # backslash
                self._escape = True
            elif c == 0x22:  # the closing quote
                if state == _KEY_STRING:
                    self._key_end(text, i)
                else:
                    self._value_end(self._token_start, i + 1)
            return
        if state == _NUMBER:
            if c in _NUMBER_BYTES:
                return
            self._value_end(self._token_start, i)
            state = self._state
        elif state == _LITERAL:
            self._literal_left -= 1
            if self._literal_left == 0:
                self._value_end(self._token_start, i + 1)
            return
        if c in _SPACE or state == _DONE:
            return
        if state == _VALUE or state == _VALUE_OR_CLOSE:
            if state == _VALUE_OR_CLOSE and c == 0x5D:  # "]" of an empty array
                self._close(i)
            else:
                self._value_start(i, c)
        elif state == _KEY_OR_CLOSE and c == 0x7D:  # "}" of an empty object
            self._close(i)
        elif (state == _KEY_OR_CLOSE or state == _KEY) and c == 0x22:
            self._state, self._token_start = _KEY_STRING, i
        elif state == _COLON and c == 0x3A:
            self._state = _VALUE
        elif state == _AFTER:
            if c == 0x2C:  # ","
                self._state = _KEY if self._stack and self._stack[-1].is_object else _VALUE
            elif c in (0x7D, 0x5D):
                self._close(i)

    def _value_start(self, i: int, c: int) -> None:
        if c == 0x7B or c == 0x5B:  # "{" or "["
            path = None
            if c == 0x7B:
                path = self._child_path()
            self._stack = (*self._stack, _Frame(c == 0x7B, path, None, i))
            self._state = _KEY_OR_CLOSE if c == 0x7B else _VALUE_OR_CLOSE
            if path is not None:
                keys = self._objects[path]
                if keys:
                    self._maybe_due((*path, keys[0]), i + 1, "")
        elif c == 0x22:
            self._state, self._token_start = _STRING, i
        elif c in _LITERAL_REST:
            self._state, self._token_start = _LITERAL, i
            self._literal_left = _LITERAL_REST[c]
        else:
            self._state, self._token_start = _NUMBER, i

    def _child_path(self) -> tuple[str, ...] | None:
        """The path of an object starting here, when it is one the plan follows."""
        if not self._stack:
            return () if () in self._objects else None
        top = self._stack[-1]
        if top.path is None or top.key is None:
            return None
        path = (*top.path, top.key)
        return path if path in self._objects else None

    def _key_end(self, text: bytes | bytearray, i: int) -> None:
        self._state = _COLON
        top = self._stack[-1]
        try:
            key = json.loads(bytes(text[self._token_start : i + 1]).decode("utf-8", "replace"))
        except ValueError:
            key = None
        self._stack = (*self._stack[:-1], top._replace(key=key))
        if top.path is not None and isinstance(key, str):
            self._maybe_due((*top.path, key), i + 1, ": ")

    def _value_end(self, start: int, end: int) -> None:
        self._state = _AFTER if self._stack else _DONE
        if not self._stack:
            return
        top = self._stack[-1]
        if top.path is None or top.key is None:
            return
        path = (*top.path, top.key)
        self._values = (*self._values, (path, start, end))
        keys = self._objects[top.path]
        if top.key in keys:
            index = keys.index(top.key)
            if index + 1 < len(keys):
                self._maybe_due((*top.path, keys[index + 1]), end, ", ")

    def _close(self, i: int) -> None:
        frame = self._stack[-1]
        self._stack = self._stack[:-1]
        self._value_end(frame.start, i + 1)

    def _maybe_due(self, path: tuple[str, ...], anchor: int, separator: str) -> None:
        index = self._field_at.get(path)
        if index is None or index in self._triggered:
            return
        self._triggered = self._triggered | {index}
        prefix = separator if separator == ": " else f"{separator}{_key(path[-1])}: "
        self._dues.append(Due(index, anchor, prefix))


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)
