"""What the SDK knows of a compiler, whatever the guest's language: the one exception its
refusal becomes, and which compiler ran, with its version against the pinned one, how it is
started and what it reads (the sandbox exposes exactly that, read-only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildError", "Compiler"]


class BuildError(Exception):
    """The compiler refused the source, or the build's sandbox stopped it; ``output`` holds
    the compiler's diagnostics verbatim."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message + (f"\n{output}" if output else ""))
        self.output = output


@dataclass(frozen=True)
class Compiler:
    """A compiler found to run: ``program`` (``rustc``, ``asc``) at ``path``, its ``version``,
    and the ``pinned`` version the SDK's reproducible builds are made with.

    ``launcher`` is how it is started when not by ``path`` itself (``node`` and the script of
    asc); ``needs`` are the folders it reads besides ``/usr`` (the ziglang package, a Rust
    sysroot, the asc package): the build's sandbox shows it those, read-only, and nothing else
    of the builder's files.
    """

    program: str
    path: str
    version: str
    pinned: str
    launcher: tuple[str, ...] = ()
    needs: tuple[Path, ...] = ()

    @property
    def argv(self) -> tuple[str, ...]:
        """The command that starts it (before its arguments)."""
        return self.launcher or (self.path,)

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
