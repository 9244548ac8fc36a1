"""The main loop's steps, against a recording stand-in for the daemon: what a step sends depends
only on the seed and its number.

The stand-in (``_RecordingContext``) records what a step sends and answers nothing, as if every
call had failed; the short profile (test_fuzz.py) runs the same steps against a real daemon.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from evald.contract import STANDARD_EVALUATORS, pb
from evald_lab.fuzz.context import Item
from evald_lab.fuzz.generate import GrammarGenerator
from evald_lab.fuzz.modules import accepted_modules, refused_modules
from evald_lab.fuzz.preparation import Arsenal
from evald_lab.fuzz.settings import SHORT
from evald_lab.fuzz.steps import CLASSES, STEPS
from evald_lab.fuzz.tally import Recorder
from evaluators_wasm import SOURCE_DIR


class _RecordingClient:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def register(self, wasm: bytes, replace: bool = False) -> SimpleNamespace:
        digest = hashlib.sha256(wasm).hexdigest()
        self.log.append(("register", digest, replace))
        return SimpleNamespace(name=f"m_{digest[:8]}")

    def delete(self, name: str) -> None:
        self.log.append(("delete", name))


class _RecordingContext:
    """Records every send and registration; every call "fails" (no responses to check)."""

    victim, attacker = "victim", "attacker"

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.secrets = SimpleNamespace(victim_canary="CANARY-V-test", victim_echo="v_echo_test")
        self.recorder = Recorder(CLASSES)

    def client(self, tenant: str, **_options: object) -> _RecordingClient:
        return _RecordingClient(self.log)

    def send(
        self, klass: str, tenant: str, items: Sequence[Item], *, via: str = "batch", **_: object
    ) -> list[tuple[pb.EvaluateRequest, None]]:
        self.log.append((klass, tenant, via, [(i.evaluator, i.data, i.family) for i in items]))
        return [(pb.EvaluateRequest(evaluator=i.evaluator, input=i.data), None) for i in items]


@pytest.fixture(scope="module")
def tables() -> dict[str, Any]:
    return {
        "generators": {
            name: GrammarGenerator((SOURCE_DIR / name / "grammar.ebnf").read_text())
            for name in sorted(STANDARD_EVALUATORS)
        },
        "accepted": accepted_modules("m1_", output_bytes=4096, shadow_name="v_echo_test"),
        "refused": refused_modules("m1_", memory_bytes=8 << 20, module_bytes=4 << 20),
    }


def _sent(tables: dict[str, Any], klass: str, number: int) -> list[tuple[Any, ...]]:
    ctx = _RecordingContext()
    arsenal = Arsenal(ctx, SHORT, tables["generators"], tables["accepted"], tables["refused"])
    STEPS[klass](arsenal, random.Random(f"1:{klass}:{number}"))
    return ctx.log


@pytest.mark.parametrize("klass", ["generated", "corpus", "modules"])
def test_a_step_sends_what_its_seed_and_number_say(tables: dict[str, Any], klass: str) -> None:
    first = _sent(tables, klass, 3)
    assert first and first[0][0] == klass
    assert _sent(tables, klass, 3) == first
    assert _sent(tables, klass, 4) != first


def test_the_classes_are_the_reports() -> None:
    assert CLASSES == ("generated", "corpus", "modules", "protocol")
    assert set(SHORT.shares) == set(CLASSES)
