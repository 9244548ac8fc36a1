"""No product function over 80 lines and no product module over 600, unless its docstring says
why it must be one piece.

Long functions and modules are where a reader loses the thread and a change its room; the
limits are the project's standard. A piece that must stay whole (a generated table, a measured
hot path) says so in its own docstring with a line that starts with :data:`MARKER`, followed by
the reason: the exception is written where a reader meets it, never in a list here.

Walked: the product packages (``evald``, ``engine_adapter``, ``evaluators_wasm``), not the
generated gRPC stubs (``evald/v1``), the lab or the tests.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("evald", "engine_adapter", "evaluators_wasm")
GENERATED = (ROOT / "evald" / "v1",)
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600
#: The start of a docstring line that says why a function or module must be one piece.
MARKER = "One piece:"

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _says_one_piece(docstring: str | None) -> bool:
    """Whether a docstring holds a line starting with :data:`MARKER` and a reason after it."""
    for line in (docstring or "").splitlines():
        text = line.strip()
        if text.startswith(MARKER) and text[len(MARKER) :].strip():
            return True
    return False


def oversized(source: str, name: str) -> Iterator[str]:
    """What in ``source`` (a module called ``name``) is over a limit without saying why."""
    tree = ast.parse(source)
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES and not _says_one_piece(ast.get_docstring(tree)):
        yield f"{name}: module of {lines} lines (over {MAX_MODULE_LINES})"
    for node in ast.walk(tree):
        if isinstance(node, Function):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _says_one_piece(ast.get_docstring(node)):
                yield (
                    f"{name}:{node.lineno}: function {node.name} of {length} lines "
                    f"(over {MAX_FUNCTION_LINES})"
                )


def _product_modules() -> Iterator[Path]:
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not any(path.is_relative_to(folder) for folder in GENERATED):
                yield path


def test_the_walk_sees_the_product_and_skips_the_stubs() -> None:
    seen = {path.relative_to(ROOT).as_posix() for path in _product_modules()}
    assert "evald/host/_call_path.py" in seen and "engine_adapter/__init__.py" in seen
    assert not any(path.startswith("evald/v1/") for path in seen)


def test_the_check_finds_a_long_function_and_module_and_takes_a_reason() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_function = f"def long():\n{body}\n"
    assert [finding.split(": ", 1)[1] for finding in oversized(long_function, "m")] == [
        f"function long of {MAX_FUNCTION_LINES + 1} lines (over {MAX_FUNCTION_LINES})"
    ]
    excused = f'def long():\n    """{MARKER} a measured hot path."""\n{body}\n'
    assert list(oversized(excused, "m")) == []
    bare_marker = f'def long():\n    """{MARKER}"""\n{body}\n'
    assert len(list(oversized(bare_marker, "m"))) == 1  # a marker needs its reason
    long_module = "\n" * MAX_MODULE_LINES + "x = 1\n"
    assert list(oversized(long_module, "m")) == [
        f"m: module of {MAX_MODULE_LINES + 1} lines (over {MAX_MODULE_LINES})"
    ]
    assert (
        list(oversized(f'"""Doc.\n\n{MARKER} a generated table.\n"""\n' + long_module, "m")) == []
    )


def test_no_product_function_or_module_is_over_its_limit_without_a_reason() -> None:
    findings = [
        finding
        for path in _product_modules()
        for finding in oversized(
            path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
        )
    ]
    assert not findings, (
        "split these, or give the docstring a line starting "
        f"{MARKER!r} that says why it must be one piece:\n" + "\n".join(findings)
    )
