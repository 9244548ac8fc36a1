"""The WAT module generator for the host and daemon tests (it lives in ``evald_lab.wat_corpus``,
because ``evald fuzz`` builds the same modules at run time)."""

from __future__ import annotations

from evald_lab.wat_corpus import IN_PTR, MANIFEST, PAGE, arg, guest, manifest_bytes, wat_text

__all__ = ["IN_PTR", "MANIFEST", "PAGE", "arg", "guest", "manifest_bytes", "wat_text"]
