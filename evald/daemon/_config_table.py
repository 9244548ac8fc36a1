"""Reading a config's TOML tables: type checks, ranges, sizes, and errors that name the key.

Why apart: every table of the config (``[server]``, ``[host]``, ``[store]``, ``[defaults]``,
each ``[[tenants]]``) and a fleet store's tenant rows are read through the same
:class:`ConfigTable`, so a wrong type, a value out of range or an unknown key is refused with the
same kind of message everywhere: the file, the key's full path, what was expected.

Sizes may be written as integers (bytes) or as strings with a binary unit (``"64MiB"``,
``"256KiB"``): :func:`parse_size`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["GIB", "KIB", "MIB", "ConfigError", "ConfigTable", "parse_size"]

KIB: Final = 1024
MIB: Final = 1024 * KIB
GIB: Final = 1024 * MIB

_SIZE = re.compile(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB}


class ConfigError(ValueError):
    """The config is invalid; the message names the file and the key, and says what is expected."""


def parse_size(value: object, where: str = "size") -> int:
    """Bytes from an integer or a string such as ``"64MiB"``.

    Raises:
        ConfigError: not a non-negative integer or a size string (the message names ``where``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{where}: expected a size >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match:
            return int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    raise ConfigError(
        f'{where}: expected a size (bytes, or a string like "64MiB", "256KiB"), got {value!r}'
    )


class ConfigTable:
    """Reads one TOML table with type checks; :meth:`finish` refuses keys nobody asked for.

    ``path`` is the table's place in the file (``tenants[0].limits``), ``source`` the file.
    """

    def __init__(self, data: object, path: str, source: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {path}: expected a table, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.path = path
        self.source = source
        self.seen: set[str] = set()

    def _where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self._where(key)}: {message}")

    def _get(self, key: str) -> Any:
        self.seen.add(key)
        return self.data.get(key)

    def has(self, key: str) -> bool:
        return key in self.data

    def get_int(
        self, key: str, default: int, *, minimum: int = 0, maximum: int | None = None
    ) -> int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"expected an integer >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.error(key, f"expected an integer <= {maximum}, got {value}")
        return value

    def get_float(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        if not math.isfinite(value) or value < minimum:
            raise self.error(key, f"expected a finite number >= {minimum}, got {value}")
        return float(value)

    def get_size(self, key: str, default: int, *, minimum: int = 0) -> int:
        value = self._get(key)
        if value is None:
            return default
        try:
            size = parse_size(value, self._where(key))
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: {exc}") from None
        if size < minimum:
            raise self.error(key, f"expected a size >= {minimum} bytes, got {size}")
        return size

    def get_str(self, key: str, default: str, *, choices: tuple[str, ...] = ()) -> str:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"expected a string, got {value!r}")
        if choices and value not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def get_str_list(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.error(key, f"expected a list of strings, got {value!r}")
        return tuple(value)

    def get_table(self, key: str) -> ConfigTable:
        value = self._get(key)
        return ConfigTable({} if value is None else value, self._where(key), self.source)

    def get_tables(self, key: str) -> list[ConfigTable]:
        value = self._get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, "expected an array of tables ([[" + key + "]])")
        return [
            ConfigTable(item, f"{self._where(key)}[{index}]", self.source)
            for index, item in enumerate(value)
        ]

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            expected = ", ".join(sorted(self.seen))
            raise self.error(unknown[0], f"unknown key (expected one of: {expected})")
