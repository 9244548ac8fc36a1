"""The standard evaluators' names: what every daemon serves and reserves, and clients ask for.

The names are the contract; the modules are data. The daemon reserves these names (and their
tags) whether or not a module is installed, a config may list them per tenant, and the engine
adapter asks for them by name. Their sources, built modules and references are the guest
package ``evaluators_wasm`` (a test holds its folders to this list).
"""

from __future__ import annotations

from typing import Final

__all__ = ["STANDARD_EVALUATORS"]

STANDARD_EVALUATORS: Final = ("calc", "strop", "date", "units", "checksum")
