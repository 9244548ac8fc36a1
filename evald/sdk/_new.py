"""``evald new``: an evaluator folder from a template, in any of the SDK's languages.

Two templates (:data:`TEMPLATES`), each in Zig, C, Rust and AssemblyScript:

* ``evaluator`` (the default): a span's text in, a value out (Roman numerals);
* ``policy``: one JSON object in, one JSON value out, with the SDK's JSON library of the
  language (``evald_json``), and a manifest that declares ``input_schema``, ``result_schema``
  and examples, which ``evald test`` holds the module to (:mod:`evald.sdk._conformance`).

Both build with ``evald build`` and pass ``evald test`` as written. A template's files live
under :data:`TEMPLATE_DIR` (the policy's under ``policy/``, which overrides the evaluator's
source, manifest, grammar and cases and shares the rest: ``Cargo.toml``, ``package.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from evald.contract import ErrorCode, EvaldError, parse_manifest
from evald.sdk._assemblyscript import GUEST_PACKAGES
from evald.sdk._rust import GUEST_CRATE
from evald.sdk._toolchain import LANGUAGES

__all__ = ["TEMPLATES", "TEMPLATE_DIR", "new_evaluator", "template_files"]

TEMPLATE_DIR: Final = Path(__file__).resolve().parent / "_templates"
#: The templates ``evald new --template`` offers; the first is the default.
TEMPLATES: Final = ("evaluator", "policy")
_TEMPLATE_FILES: Final = ("manifest.json", "grammar.ebnf", "cases.jsonl")
#: Each language's own template files (below TEMPLATE_DIR), the source first; a file under a
#: language folder (``rust/src/lib.rs``) lands without that folder (``src/lib.rs``).
_LANGUAGE_FILES: Final = {
    "zig": ("main.zig",),
    "c": ("main.c",),
    "rust": ("rust/src/lib.rs", "rust/Cargo.toml"),
    "assemblyscript": (
        "assemblyscript/assembly/index.ts",
        "assemblyscript/assembly/tsconfig.json",
        "assemblyscript/package.json",
    ),
}
#: Where a project's package manifest names the guest library, for Cargo, npm and editors
#: (``evald build`` itself always compiles against the SDK's copy).
_GUEST_PATHS: Final = {"rust": GUEST_CRATE, "assemblyscript": GUEST_PACKAGES / "evald-guest"}


def _usage(message: str) -> EvaldError:
    return EvaldError(ErrorCode.INVALID_ARGUMENT, message)


def template_files(language: str, template: str = "evaluator") -> dict[str, Path]:
    """A language's template: destination (relative to the new folder) -> template file, the
    source first, then the language's other files, then the manifest, grammar and cases.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` for an unknown language or template.
    """
    if language not in _LANGUAGE_FILES:
        raise _usage(f"unknown language {language!r}; choose one of {', '.join(LANGUAGES)}")
    if template not in TEMPLATES:
        raise _usage(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    override = TEMPLATE_DIR / template if template != TEMPLATES[0] else None

    def source(path: str) -> Path:
        if override is not None and (override / path).is_file():
            return override / path
        return TEMPLATE_DIR / path

    files = {
        path.split("/", 1)[1] if "/" in path else path: source(path)
        for path in _LANGUAGE_FILES[language]
    }
    return {**files, **{name: source(name) for name in _TEMPLATE_FILES}}


def new_evaluator(
    name: str, folder: Path, language: str = "zig", template: str = "evaluator"
) -> list[Path]:
    """Creates an evaluator folder from a template, with ``name`` as its name and tag.

    Parameters:
        name: the evaluator's name and tag (``[a-z][a-z0-9_]{0,31}``, not a standard name).
        folder: created if missing; must be empty if it exists.
        language: ``zig``, ``c``, ``rust`` or ``assemblyscript``.
        template: ``evaluator`` (span text in, a value out) or ``policy`` (JSON in and out).

    Returns:
        The files written, source first.

    Raises:
        EvaldError: ``INVALID_ARGUMENT`` for a bad name, language or template, or a non-empty
            folder.
    """
    from evald.daemon import check_not_reserved

    files = template_files(language, template)
    manifest: dict[str, Any] = json.loads(files["manifest.json"].read_text("utf-8"))
    manifest.update(name=name, tag=name, semantics_version=f"{name}/1")
    grammar = files["grammar.ebnf"].read_text("utf-8")
    try:  # the ABI's own field rules, so `new` refuses exactly what registration would
        parse_manifest(json.dumps({**manifest, "input_grammar": grammar}).encode())
    except EvaldError as exc:
        raise _usage(f"cannot use {name!r} as an evaluator name: {exc.message}") from None
    check_not_reserved(name, name)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise _usage(f"{folder} already exists and is not an empty folder; pick another --dir")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for destination, source in files.items():
        target = folder / destination
        target.parent.mkdir(parents=True, exist_ok=True)
        if destination == "manifest.json":
            target.write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
        elif destination in ("Cargo.toml", "package.json"):
            text = source.read_text("utf-8").replace('"NAME"', f'"{name}"')
            guest = _GUEST_PATHS[language].as_posix()
            target.write_text(text.replace("EVALD_GUEST", guest), "utf-8")
        else:
            target.write_bytes(source.read_bytes())
        written.append(target)
    return written
