"""What the SDK knows of a compiler, whatever the guest's language: the one exception its
refusal becomes, and which compiler ran, with its version against the pinned one."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BuildError", "Compiler"]


class BuildError(Exception):
    """The compiler refused the source; ``output`` holds its diagnostics verbatim."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message + (f"\n{output}" if output else ""))
        self.output = output


@dataclass(frozen=True)
class Compiler:
    """A compiler found to run: ``program`` (``rustc``, ``asc``) at ``path``, its ``version``,
    and the ``pinned`` version the SDK's reproducible builds are made with."""

    program: str
    path: str
    version: str
    pinned: str

    def describe(self) -> str:
        return f"{self.program} {self.version} ({self.path})"

    def warnings(self) -> list[str]:
        """A warning when this is not the pinned version (the bytes may then differ)."""
        if self.version == self.pinned:
            return []
        return [
            f"{self.describe()} is not the {self.program} {self.pinned} evald's builds are "
            "pinned to, so this module may differ byte for byte from a pinned build"
        ]
