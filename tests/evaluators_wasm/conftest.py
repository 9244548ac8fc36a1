"""Fixtures for the evaluator tests.

``run_guest(name, data)`` runs a built standard evaluator on ``data`` and returns
``(value, code, message)`` — ``value`` is None on error. It is rewired onto evald's wasm host
(`evald._host`) once that exists, so these tests exercise the same path the daemon uses.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest
import wasmtime

from evaluators_wasm import wasm_path

Outcome = tuple[str | None, str | None, str]

_engine_config = wasmtime.Config()
_engine_config.consume_fuel = True
_ENGINE = wasmtime.Engine(_engine_config)
FUEL = 2_000_000_000


@cache
def _module(name: str) -> wasmtime.Module:
    return wasmtime.Module.from_file(_ENGINE, str(wasm_path(name)))


def run_guest(name: str, data: bytes) -> Outcome:
    store = wasmtime.Store(_ENGINE)
    store.set_fuel(FUEL)
    store.set_limits(memory_size=64 * 1024 * 1024)
    inst = wasmtime.Instance(store, _module(name), [])
    ex = inst.exports(store)
    mem = ex["memory"]
    in_ptr, in_cap = ex["evald_input_ptr"](store), ex["evald_input_cap"](store)
    out_ptr = ex["evald_output_ptr"](store)
    if len(data) > in_cap:
        return None, "input_too_large", f"input of {len(data)} bytes exceeds {in_cap}"
    mem.write(store, data, in_ptr)
    try:
        r = ex["evald_eval"](store, len(data))
    except wasmtime.Trap as trap:
        return None, f"trap:{trap.trap_code}", str(trap)
    payload = bytes(mem.read(store, out_ptr, out_ptr + abs(r)))
    text = payload.decode("utf-8")
    if r >= 0:
        return text, None, ""
    code, _, message = text.partition(":")
    return None, code, message


@pytest.fixture
def guest() -> Callable[[str, bytes], Outcome]:
    return run_guest
