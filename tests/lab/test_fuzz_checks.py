"""Unit tests of the fuzzer's parts: every check detects its violation, the generator speaks the
evaluators' grammars, mutation and the corpora are deterministic and bounded."""

from __future__ import annotations

import random

import pytest

from evald.contract import STANDARD_EVALUATORS, ErrorCode, pb
from evald_lab.fuzz.checks import (
    Canaries,
    Checker,
    TenantBounds,
    Violation,
    outcome_label,
)
from evald_lab.fuzz.corpus import ATTACKS, attacks_for
from evald_lab.fuzz.generate import GrammarError, GrammarGenerator, mutate, parse_ebnf
from evald_lab.fuzz.tally import Recorder
from evaluators_wasm import SOURCE_DIR

BOUNDS = {
    "victim": TenantBounds("victim", fuel=1000, deadline_ms=50, memory_bytes=1 << 20,
                           input_bytes=100, output_bytes=10),
    "attacker": TenantBounds("attacker", fuel=500, deadline_ms=20, memory_bytes=1 << 19,
                             input_bytes=100, output_bytes=10),
}  # fmt: skip


def checker() -> Checker:
    canaries = Canaries()
    canaries.add("victim", "CANARY-V", "v_secret_module", "victim-token")
    canaries.add("attacker", "CANARY-A-secret")
    return Checker(BOUNDS, canaries, margin_ms=10, result_regex={"calc": r"-?[0-9]+"})


def request(
    evaluator: str = "calc", data: bytes = b"1+1", deadline_ms: int = 0
) -> pb.EvaluateRequest:
    return pb.EvaluateRequest(evaluator=evaluator, input=data, deadline_ms=deadline_ms, id="7")


def ok(value: str = "2", **fields: int) -> pb.EvaluateResponse:
    return pb.EvaluateResponse(id="7", value=value, **fields)


def error(code: ErrorCode, message: str = "m", **fields: int) -> pb.EvaluateResponse:
    return pb.EvaluateResponse(
        id="7", error=pb.Error(code=code.proto_value, message=message), **fields
    )  # type: ignore[arg-type]


def kinds(violations: list[Violation]) -> list[str]:
    return [v.kind for v in violations]


def test_a_clean_result_passes() -> None:
    assert (
        checker().evaluation("c", "victim", request(), ok(fuel_used=1000, eval_time_us=60_000))
        == []
    )


@pytest.mark.parametrize(
    ("response", "kind"),
    [
        (ok(fuel_used=1001), "fuel_escape"),
        (ok(eval_time_us=60_001), "deadline_escape"),
        (ok("12345678901"), "output_escape"),
        (ok("x"), "bad_value"),
        (pb.EvaluateResponse(id="7"), "untyped_error"),
        (error(ErrorCode.INTERNAL), "internal_error"),
        (pb.EvaluateResponse(id="8", value="2"), "missing_result"),
    ],
)
def test_each_evaluation_check_detects_its_violation(
    response: pb.EvaluateResponse, kind: str
) -> None:
    assert kind in kinds(checker().evaluation("c", "victim", request(), response))


def test_a_requested_deadline_lowers_the_bound() -> None:
    check = checker()
    assert check.evaluation("c", "victim", request(deadline_ms=5), ok(eval_time_us=14_000)) == []
    late = check.evaluation("c", "victim", request(deadline_ms=5), ok(eval_time_us=16_000))
    assert kinds(late) == ["deadline_escape"]
    # a request cannot raise its deadline above the tenant's
    raised = check.evaluation("c", "victim", request(deadline_ms=10_000), ok(eval_time_us=61_000))
    assert kinds(raised) == ["deadline_escape"]


def test_an_oversized_input_must_be_refused() -> None:
    big = request(data=b"1" * 101)
    assert kinds(checker().evaluation("c", "victim", big, ok())) == ["input_escape"]
    assert checker().evaluation("c", "victim", big, error(ErrorCode.INPUT_TOO_LARGE)) == []


def test_another_tenants_secret_is_a_leak_in_values_and_messages() -> None:
    check = checker()
    leak = check.evaluation("c", "attacker", request("strop"), ok("xCANARY-V"))
    assert "tenant_leak" in kinds(leak)
    message = error(ErrorCode.SYNTAX, "saw victim-token here")
    assert kinds(check.evaluation("c", "attacker", request("strop"), message)) == ["tenant_leak"]
    # a tenant's own secret is not a leak
    assert check.evaluation("c", "victim", request("strop"), ok("CANARY-V")) == []


def test_what_the_caller_sent_itself_is_not_a_leak() -> None:
    # the attacker names the victim's module; the refusal repeats the name it sent
    response = error(ErrorCode.UNKNOWN_EVALUATOR, "no evaluator 'v_secret_module' for tenant")
    assert checker().evaluation("c", "attacker", request("v_secret_module"), response) == []


def test_batch_matching_finds_missing_and_stray_results() -> None:
    check = checker()
    requests = [pb.EvaluateRequest(evaluator="calc", input=b"1", id=str(i)) for i in range(3)]
    results = [pb.EvaluateResponse(id="0", value="1"), pb.EvaluateResponse(id="9", value="1")]
    found, matched = check.batch("c", "victim", requests, results, ordered=False)
    assert matched[0] is not None and matched[1] is None and matched[2] is None
    assert kinds(found).count("missing_result") >= 3  # two missing, one unknown id, a count
    in_order = [pb.EvaluateResponse(id=str(i), value="1") for i in range(3)]
    found, matched = check.batch("c", "victim", requests, in_order, ordered=True)
    assert found == [] and all(m is not None for m in matched)
    found, _ = check.batch("c", "victim", requests, in_order[:1] * 3, ordered=True)
    assert kinds(found) == ["missing_result", "missing_result"]  # ids 1 and 2 answered as 0


def test_call_level_checks() -> None:
    check = checker()
    assert kinds(check.call_error("c", None, "boom")) == ["untyped_error"]
    assert kinds(check.call_error("c", "internal", "boom")) == ["internal_error"]
    assert kinds(check.call_error("c", "quota_exceeded", "x", expected=["invalid_module"])) == [
        "unexpected"
    ]
    assert check.call_error("c", "invalid_module", "x", expected=["invalid_module"]) == []
    assert kinds(check.text("c", "attacker", "listing: v_secret_module")) == ["tenant_leak"]
    assert check.text("c", "attacker", "listing: v_secret_module", echoed=["v_secret_module"]) == []


def test_memory_rss_and_latency_bounds() -> None:
    check = checker()
    assert check.memory_pages("c", "attacker", 8) == []
    assert kinds(check.memory_pages("c", "attacker", 9)) == ["memory_escape"]
    assert Checker.rss(100, 100) == []
    assert kinds(Checker.rss(101, 100)) == ["rss_bound"]
    assert check.call_latency("c", 1.0, 0.995, "a call") == []
    assert kinds(check.call_latency("c", 1.006, 0.995, "a call")) == ["hang"]


def test_outcome_labels() -> None:
    assert outcome_label(ok()) == "ok"
    assert outcome_label(error(ErrorCode.SYNTAX)) == "syntax"
    assert outcome_label(pb.EvaluateResponse()) == "untyped"
    unknown = pb.EvaluateResponse(error=pb.Error(code=99))  # type: ignore[arg-type]
    assert outcome_label(unknown) == "untyped"


def test_recorder_counts_outcomes_violations_and_stalls() -> None:
    recorder = Recorder(["generated"])
    recorder.outcome("generated", "ok", family="calc:valid", eval_us=5)
    recorder.outcome("generated", "syntax", family="calc:mutated", eval_us=9)
    recorder.add([Violation("fuel_escape", "generated", "x")])
    recorder.stall("generated", 700.0)
    stats = recorder.classes["generated"].to_json()
    assert stats["inputs"] == 2 and stats["ok"] == 1 and stats["typed_errors"] == 1
    assert stats["max_eval_us"] == 9 and stats["violations"] == {"fuel_escape": 1}
    assert stats["stalls"] == 1 and recorder.violation_total == 1


# Generation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", STANDARD_EVALUATORS)
def test_generated_sentences_are_in_the_evaluators_grammar(name: str) -> None:
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    text = (SOURCE_DIR / name / "grammar.ebnf").read_text()
    grammar = xgrammar.Grammar.from_ebnf(text)
    generator = GrammarGenerator(text)
    rng = random.Random(name)
    for _ in range(40):
        sentence = generator.generate(rng)
        assert _is_grammar_accept_string(grammar, sentence), (name, sentence)


def test_generation_is_reproducible_from_the_seed() -> None:
    generator = GrammarGenerator((SOURCE_DIR / "calc" / "grammar.ebnf").read_text())
    first = [generator.generate(random.Random(3)) for _ in range(2)]
    assert first[0] == first[1]


def test_unreadable_grammars_are_refused() -> None:
    with pytest.raises(GrammarError):
        parse_ebnf("expr ::= [a-z")
    with pytest.raises(GrammarError):
        parse_ebnf('start ::= "x"')  # no root
    with pytest.raises(GrammarError):
        GrammarGenerator("root ::= missing")


def test_mutation_is_deterministic_and_bounded() -> None:
    seed = b"(1 + 2) * 3"
    a = [mutate(seed, random.Random(i), max_bytes=4096) for i in range(200)]
    b = [mutate(seed, random.Random(i), max_bytes=4096) for i in range(200)]
    assert a == b
    assert all(len(x) <= 4096 for x in a)
    assert len(set(a)) > 150  # mutations differ


def test_every_evaluator_has_attacks_and_each_draw_is_bounded() -> None:
    rng = random.Random(0)
    for name in STANDARD_EVALUATORS:
        families = {attack.family for attack in attacks_for(name) if attack.evaluator == name}
        assert families, name
    for attack in ATTACKS:
        for _ in range(3):
            data = attack.draw(rng)
            assert isinstance(data, bytes)
            assert len(data) <= 2_000_001, attack.family
    deep = next(a for a in ATTACKS if a.family == "deep_nesting_1m" and a.evaluator == "calc")
    depths = {len(deep.draw(random.Random(i))) for i in range(60)}
    assert max(depths) >= 1_000_000  # nesting up to a million


def test_a_call_that_finds_an_earlier_calls_state_is_a_call_leak() -> None:
    from evald.testing import REMEMBERED_NOTHING, remembered

    check = checker()
    assert check.nothing_survived("modules", "attacker", REMEMBERED_NOTHING) == []
    found = check.nothing_survived("modules", "attacker", remembered(b"secretword"))
    assert kinds(found) == ["call_leak"]
    assert "secretword" in found[0].detail
